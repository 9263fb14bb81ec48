"""Which codec stores a state and which one wrote a checkpoint, asked of the codecs registered
(`codec.register`); the built-in ones are imported here, which registers them (kept apart from the
codec base so that the codecs' modules import that base and this imports them without a circle)."""

from __future__ import annotations

from typing import Any, Dict, List

from . import replicated, sharded  # noqa: F401  (registers them)
from .codec import Codec, codecs
from .formatspec import spec_of


def registered() -> List[Codec]:
    """Every codec, in the order `for_state` asks them: as registered, the catch-all one (the replicated
    codec, which takes any state) last."""
    return [cls() for cls in sorted(codecs(), key=lambda cls: cls.catch_all)]


def for_state(objects: Dict[str, Any]) -> Codec:
    """The codec that stores these states (name -> state)."""
    return next(codec for codec in registered() if codec.wants(objects))


def for_manifest(manifest: Dict[str, Any]) -> Codec:
    """The codec that wrote a (validated) manifest. ValueError (the checkpoint is unusable here) when
    no codec of its format is registered in this process (its spec only: a torch-free module's)."""
    spec = spec_of(manifest.get("format"))
    codec = next((codec for codec in registered() if spec is not None and codec.format == spec.number), None)
    if codec is None:
        raise ValueError(f"format {str(manifest.get('format'))[:20]}: no codec that reads it is registered in this process")
    return codec
