"""The codecs there are, and which one stores a state or wrote a checkpoint (the registry of
`codec.Codec`, kept apart from that base so that the codecs' modules import it and it imports them
without a circle)."""

from __future__ import annotations

from typing import Any, Dict, List

from .codec import Codec
from .replicated import PerObjectCodec, ReplicatedCodec
from .sharded import ShardedCodec


def registered() -> List[Codec]:
    """Every codec, in the order `for_state` asks them (the replicated one, which takes any state, last
    but for those that only read)."""
    return [ShardedCodec(), ReplicatedCodec(), PerObjectCodec()]


def for_state(objects: Dict[str, Any]) -> Codec:
    """The codec that stores these states (name -> state)."""
    return next(codec for codec in registered() if codec.wants(objects))


def for_manifest(manifest: Dict[str, Any]) -> Codec:
    """The codec that wrote a (validated) manifest."""
    return next(codec for codec in registered() if codec.format == manifest.get("format"))
