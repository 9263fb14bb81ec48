"""The replicated format's manifest side (no torch): its FormatSpecs, format 4 (one file, state.bin,
written by rank 0) and format 2 (a file per object: read, no longer written). Neither has fields of its
own (replicated.py checks a checkpoint's files against its manifest as it reads them)."""

from __future__ import annotations

from .formatspec import FormatSpec, register

REPLICATED = register(FormatSpec(4, "replicated"))
PER_OBJECT = register(FormatSpec(2, "per-object"))
