"""What the manifest knows of each checkpoint format (no torch: the launcher's pre-flight reads
manifests): its number, the manifest's `format`; its name; and the check of the manifest fields that
are its own (the sharded format's tensor table). The manifest validates the fields every checkpoint
has and asks the registry here for the rest; it names no format itself.

A format registers its FormatSpec where the pre-flight sees it without torch: the built-in ones in
torch-free modules the checkpoint package imports (replicated_spec, piecetable). A codec's
`@register` (codec.py) registers its spec too, so a format whose checker needs no pre-flight is one
module. Also here: the shapes of fields that formats' checks share.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

TENSOR_KEY = re.compile(r"[^\x00-\x1f]{1,1024}")  # a tensor's key (or a parameter's name): no control characters


def integer(value: Any, low: int, high: int) -> bool:
    """Whether `value` is an int (not a bool) from `low` to `high`."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def no_fields(manifest: Dict[str, Any]) -> Optional[str]:
    """The check of a format that has no fields of its own."""
    return None


@dataclass(frozen=True)
class FormatSpec:
    number: int  # the manifest's `format`
    name: str
    # why the manifest's fields that are this format's own are unusable (None: they are usable), called
    # with the manifest once its common fields are validated; it never raises
    fields: Callable[[Dict[str, Any]], Optional[str]] = no_fields


_SPECS: Dict[int, FormatSpec] = {}


def register(spec: FormatSpec) -> FormatSpec:
    """Add a format. The same spec registered again (its module executed again, or its codec's
    `@register` after its torch-free module) replaces it; another format's number or name is an error."""
    if not integer(spec.number, 0, 2**31):
        raise ValueError(f"format {spec.name!r}: its number {spec.number!r} is not an integer from 0 to {2**31}")
    for known in _SPECS.values():
        if (known.number == spec.number) != (known.name == spec.name):
            raise ValueError(f"format {spec.number} {spec.name!r}: format {known.number} is registered as {known.name!r}")
    _SPECS[spec.number] = spec
    return spec


def spec_of(value: Any) -> Optional[FormatSpec]:
    """The registered format a manifest's `format` value names (None: none this process reads). Compared
    by equality, as a manifest was always read (4.0 is 4); a bool is never a format."""
    if isinstance(value, bool):
        return None
    return next((spec for spec in _SPECS.values() if spec.number == value), None)


def numbers() -> List[int]:
    """The formats this process reads, in order."""
    return sorted(_SPECS)
