"""The manifests of one writer, sealed (manifest.seal's bytes) with the fields that are the same in
every one (a run's configs, most of a manifest's bytes) encoded and read back once, not at each save.
What is written is byte for byte what manifest.seal writes for the whole manifest, and what a reader
gets back of it is validated before it is written."""

from __future__ import annotations

import json
from typing import Any, Dict

from .manifest import DIGEST, sealed_text, validate


def encode_fields(fields: Dict[str, Any]) -> str:
    """Manifest fields encoded once for `seal(..., encoded)`: the bytes `seal` writes for them at the
    end of a manifest (each as json.dumps writes it one level down)."""
    return "".join(
        ",\n" + json.dumps({key: value}, indent=1, default=str)[2:-2] for key, value in fields.items() if key != DIGEST
    )


class Sealer:
    """The manifests of one writer, whose `constant` fields (the configs) are the same in every one:
    those encoded and read back once, each manifest's own fields per seal."""

    def __init__(self, constant: Dict[str, Any]) -> None:
        self.encoded = encode_fields(constant)
        self.read_back = json.loads("{" + self.encoded[1:] + "\n}")  # what a reader gets of them

    def seal(self, fields: Dict[str, Any], where: Any, step: int) -> bytes:
        """The bytes of the manifest of `fields` and the constant ones, once what a reader gets back
        of them validates (ManifestError otherwise: what we write, our reader accepts)."""
        text = json.dumps({k: v for k, v in fields.items() if k != DIGEST}, indent=1, default=str)
        validate({**json.loads(text), **self.read_back}, where, step)
        return sealed_text(text, self.encoded)
