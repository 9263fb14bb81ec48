"""Whether a value fits a type hint, as far as a record read from JSON can: what the event writer checks
and the reader trusts."""

from __future__ import annotations

import numbers
from typing import Any, Dict, Mapping, Union, get_args, get_origin, get_type_hints

_FIELD_TYPES: Dict[type, Dict[str, Any]] = {}


def field_types(cls: type) -> Dict[str, Any]:
    """A dataclass's fields and their types (its class variables, named in capitals, left out)."""
    if cls not in _FIELD_TYPES:
        _FIELD_TYPES[cls] = {k: v for k, v in get_type_hints(cls).items() if not k.isupper()}
    return _FIELD_TYPES[cls]


def fits(hint: Any, value: Any) -> bool:
    """Whether `value` is of type `hint` (None always is: every field of a record is optional)."""
    if value is None or hint is Any:
        return True
    origin = get_origin(hint)
    if origin is Union:
        return any(fits(arg, value) for arg in get_args(hint) if arg is not type(None))
    if origin is list:
        return isinstance(value, (list, tuple))
    if origin is dict:
        return isinstance(value, Mapping)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    return isinstance(value, hint)
