"""A character-level corpus every machine has offline: the Python standard library's own sources.

`stdlib_text(max_chars)` reads the `.py` files under `sysconfig.get_paths()["stdlib"]` depth first,
each folder's entries sorted by name (installed packages, generated build data and caches left
out), and keeps the first `max_chars` characters: the same text on every machine with the same Python, and
nothing is downloaded. `CharCorpus` maps it to indices over its own sorted character set, and
`windows` cuts the indices into fixed-length input/target windows (targets shifted by one), an
in-memory `TensorDataset` that `steadfast.Run.loader` fetches a batch at a time.

Used by `data=text` (the built-in trainer) and by examples/charlm (an own loop): one corpus, one
vocabulary, one windowing.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils.data import TensorDataset

DEFAULT_MAX_CHARS = 1_000_000
SKIPPED_DIRS = ("site-packages", "dist-packages", "__pycache__")  # installed packages differ between machines
SKIPPED_PREFIX = "_sysconfigdata"  # generated at build time, differs between builds


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path) -> Iterator[Path]:
    """The standard library's own Python sources, depth first, each folder's entries sorted by name
    (a walk that can stop as soon as it has read enough)."""
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            if entry.name not in SKIPPED_DIRS:
                yield from stdlib_files(Path(entry.path))
        elif entry.name.endswith(".py") and not entry.name.startswith(SKIPPED_PREFIX) and entry.is_file(follow_symlinks=False):
            yield Path(entry.path)


def stdlib_text(max_chars: int = DEFAULT_MAX_CHARS, root: Optional[Path] = None) -> str:
    """The first `max_chars` characters of the standard library's sources, concatenated in walk order."""
    root = root or stdlib_root()
    parts: List[str] = []
    total = 0
    for path in stdlib_files(root):
        try:
            text = path.read_bytes().decode("utf-8", errors="replace")
        except OSError:
            continue  # an unreadable file is skipped the same way on every run of this machine
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    text = "".join(parts)[:max_chars]
    if len(text) < max_chars:
        raise RuntimeError(
            f"data=text: the Python sources under {root} hold only {len(text)} characters, "
            f"fewer than data.max_chars={max_chars}; lower data.max_chars"
        )
    return text


@dataclass(frozen=True)
class CharCorpus:
    """A text and its vocabulary (its sorted characters); `sha256` identifies the text."""

    text: str
    chars: str
    sha256: str

    @classmethod
    def from_text(cls, text: str) -> "CharCorpus":
        return cls(text, "".join(sorted(set(text))), hashlib.sha256(text.encode("utf-8")).hexdigest())

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        index = {c: i for i, c in enumerate(self.chars)}
        unknown = sorted(set(text) - set(index))
        if unknown:
            raise ValueError(f"characters not in the corpus's vocabulary: {''.join(unknown)!r}")
        return torch.tensor([index[c] for c in text], dtype=torch.long)

    def decode(self, ids: Any) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def load_corpus(max_chars: int = DEFAULT_MAX_CHARS) -> CharCorpus:
    return CharCorpus.from_text(stdlib_text(max_chars))


def windows(ids: torch.Tensor, block_size: int, stride: int) -> TensorDataset:
    """Every window of `block_size + 1` indices starting at a multiple of `stride`: inputs are its
    first `block_size`, targets its last `block_size` (the next character at every position)."""
    if len(ids) < block_size + 1:
        raise ValueError(f"{len(ids)} characters cannot fill one window of data.block_size={block_size} (+1 for the target)")
    starts = torch.arange(0, len(ids) - block_size, stride)
    rows = ids[starts.unsqueeze(1) + torch.arange(block_size + 1)]
    return TensorDataset(rows[:, :-1].contiguous(), rows[:, 1:].contiguous())


def split(corpus: CharCorpus, block_size: int, stride: int, val_fraction: float) -> Tuple[TensorDataset, TensorDataset]:
    """Training and validation windows from two separate stretches of the text (its last
    `val_fraction` is held out whole, so no validation character is ever trained on)."""
    ids = corpus.encode(corpus.text)
    cut = len(ids) - max(block_size + 1, int(round(len(ids) * val_fraction)))
    return windows(ids[:cut], block_size, stride), windows(ids[cut:], block_size, block_size)


class Vocabulary:
    """The corpus's identity in a checkpoint (`run.resume(vocab=Vocabulary(corpus))`): a resume on a
    machine whose standard library gives another text is refused instead of training on a different
    mapping, and a sampler decodes with the saved characters."""

    def __init__(self, corpus: CharCorpus) -> None:
        self.corpus = corpus

    def state_dict(self) -> Dict[str, Any]:
        return {"chars": self.corpus.chars, "sha256": self.corpus.sha256}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("chars") != self.corpus.chars or state.get("sha256") != self.corpus.sha256:
            raise ValueError(
                f"the checkpoint was trained on another corpus (sha256 {state.get('sha256')}) than this "
                f"machine's standard library gives (sha256 {self.corpus.sha256}): another Python version?"
            )
