"""What a Hydra job returned, value or failure: a JobReturn keeps it in its private field
`_return_value`, and its public `return_value` raises it when the job failed (after writing a line
to stderr), so the sweep reads the field."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from hydra.core.utils import JobReturn

from . import Patch, applies


def _shape() -> Optional[str]:
    fields = {f.name for f in dataclasses.fields(JobReturn)}
    return None if "_return_value" in fields else "JobReturn has no _return_value field"


RETURN_VALUE = Patch(
    "a failed job's exception read without raising it",
    "hydra-core",
    ">=1.3,<1.4",
    _shape,
    "Hydra writes 'Error executing job ...' to stderr for each failed job the sweep looks at",
)


def returned(ret: JobReturn) -> Any:
    """The job's return value, or the exception it failed with."""
    if applies(RETURN_VALUE):
        return ret._return_value
    try:
        return ret.return_value
    except BaseException as failure:  # what it failed with, raised by the property
        return failure
