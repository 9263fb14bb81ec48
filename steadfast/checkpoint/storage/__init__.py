"""Where a checkpoint's bytes go: one Store interface, one module per store (no torch).

  base      Store, the interface (stage, write, commit, list, read, set aside, discard, check), a
            checkpoint's Files as a codec reads them, the layout's names, the registry (`register`, `store_for`)
  posix     a folder on a filesystem: the rename that commits, the folder scan
  fileio    whole, checked writes and bounded, validated reads of files (the report uses it too)
  s3        an S3 bucket (checkpoint.dir=s3://bucket/prefix): the manifest put last commits; the
            endpoint and keys from the environment, as every S3 tool takes them

A new store is one module here that ends its class with `@register` (its `scheme`), imported below.
"""

from __future__ import annotations

from . import posix, s3  # noqa: F401  (registers them)
from .base import Store, split, store_for

__all__ = ["Store", "split", "store_for"]
