"""The commit sequence of a store as its only writer follows it, so that a save's commit number
(manifest.next_commit's answer) lists the store's names and reads no manifest unless they changed."""

from __future__ import annotations

from typing import Dict, Iterable, Optional

from .manifest import Listed, commit_after, scan
from .storage import Store


class Commits:
    """The commit sequence of one store as its only writer sees it (the launcher locks a run's
    checkpoint folder): the commits of the checkpoints it listed last, kept up to date by what it
    commits and removes. `next()` lists the names again (cheap) and reads every manifest again
    (manifest.next_commit) only when they differ from those it knows, or after `forget()` (anything it did
    not follow: a set-aside, a failed commit)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._known: Optional[Dict[str, int]] = None  # name -> commit (0: a manifest that cannot be used)

    def listed(self, checkpoints: Iterable[Listed]) -> None:
        self._known = {c.name: c.commit for c in checkpoints}

    def committed(self, name: str, commit: int) -> None:
        if self._known is not None:
            self._known[name] = commit

    def removed(self, name: str) -> None:
        if self._known is not None:
            self._known.pop(name, None)

    def forget(self) -> None:
        self._known = None

    def next(self) -> int:
        """One above the highest commit in the store (next_commit's answer)."""
        if self._known is None or set(self.store.names()) != set(self._known):
            self.listed(scan(self.store))
        assert self._known is not None
        return commit_after(self._known.values())
