"""Every patch of a third-party internal, in one place, each gated on the versions it was written for.

A patch here reaches into another project's code (a private attribute, a frame's locals, a function
swapped for a while) to make the launcher faster or to keep its stop semantics. Each one is a
`Patch`: the package and the versions it was written for, and a check of the exact shape of what
it touches. It is applied only when both hold, whole or not at all; otherwise it is skipped with
one warning and the launcher runs on the third party's own behaviour. tests/launcher/test_compat.py has a
test per patch that fails when the installed version leaves its range or the internal changes, and
tests/repo/test_architecture.py fails if a third-party private name is touched outside this package.

  horovod_runner         horovod.run's workers' environment, shutdown events, Gloo check, result store
  hydra_compositions     the sweeper's composition of a job reused by the launcher
  hydra_job_return       what a failed job raised, read from Hydra's JobReturn without raising it
  hydra_overrides        Hydra's message for an unknown key: the nearest key instead of "use +KEY"
  forkserver             multiprocessing's forkserver: its pid, and ending it with the launcher
  elastic_worker         torch elastic's worker wrapper (`_wrap`): let a worker end once it returned
  torch_logging          torch's log formatter: tracebacks rendered before it imports torch._dynamo
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from importlib import metadata
from typing import Callable, Dict, Optional

from packaging.specifiers import SpecifierSet

log = logging.getLogger(__name__)

PYTHON = "python"  # Patch.package of a patch of the standard library


@dataclass(frozen=True)
class Patch:
    name: str  # what it does, for the warning
    package: str  # the distribution it patches (PYTHON: the standard library)
    versions: str  # the versions it was written for (a PEP 440 specifier)
    shape: Callable[[], Optional[str]]  # what changed in the internal it touches (None: nothing)
    without: str  # what happens when it is skipped

    def installed(self) -> Optional[str]:
        if self.package == PYTHON:
            return ".".join(str(v) for v in sys.version_info[:3])
        try:
            return metadata.version(self.package)
        except metadata.PackageNotFoundError:
            return None

    def problem(self) -> Optional[str]:
        """Why the patch must not be applied here (None: it may)."""
        version = self.installed()
        if version is None:
            return f"{self.package} is not installed"
        if not SpecifierSet(self.versions).contains(version, prereleases=True):
            return f"written for {self.package}{self.versions}, installed {version}"
        try:
            return self.shape()
        except Exception as exc:  # the internal is not there at all
            return f"{type(exc).__name__}: {exc}"


_checked: Dict[str, Optional[str]] = {}  # by patch name: what keeps it from applying (None: nothing)


def applies(patch: Patch) -> bool:
    """Whether to apply `patch` here (checked once per process, which warns when it does not)."""
    if patch.name not in _checked:
        _checked[patch.name] = problem = patch.problem()
        if problem is not None:
            log.warning("steadfast: skipped the patch '%s' (%s); without it %s", patch.name, problem, patch.without)
    return _checked[patch.name] is None
