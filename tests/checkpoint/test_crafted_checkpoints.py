"""Crafted sharded checkpoints, end to end with real workers (issue 32, findings 1-4).

A user's own FSDP2 loop (tests/apps/fsdp_loop) on 2 workers, checkpointed every 5 steps. A copy of its
uninterrupted run, cut back to step 40 (what a run stopped there leaves), has its newest checkpoints
crafted, one defect each, and an older one's commit raised by one flipped bit so that a resume
would try it first:

- step 40: one bit flipped in manifest.json, a piece's file rank00001.bin -> rank00000.bin (finding 1:
  rank 0's rows of the same shape were read in place of rank 1's): its digest no longer matches;
- step 35: the same flip in a manifest without a digest, as an earlier version wrote it: each rank
  file's own table of pieces disagrees with the manifest's;
- step 30: a tensor's two pieces listed at rows 7-21 and 8-22, plus 600 empty pieces, the digest made
  to match (finding 2: above 512 pieces the overlap check was skipped; each rank's count of the
  values it got added up, and rows 0-6 and 23-29, which no piece holds, were loaded as uninitialised
  memory);
- step 25: written by the same loop with its optimizer built over the blocks' parameters in reverse
  order (finding 4): every shape fits, only the parameters' names show that each block's Adam
  moments would land on another block;
- step 5: its commit 1 -> 9, one bit (finding 3: a resume took the older step, and retention, ranked
  by commit, then removed the newest work).

One resume must name each of them (checkpoint_invalid, with why), move them aside, start from step 20
and end with the uninterrupted run's model_sha256."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

from helpers import ROOT, env, events, run_dir, summary
from steadfast.checkpoint import manifest as mf

pytestmark = pytest.mark.slow
APP = ROOT / "tests" / "apps" / "fsdp_loop"
BASE = ["samples=240", "checkpoint.every_n_steps=5", "checkpoint.keep_last=20", "snapshot=off"]
SPLIT = "model.inp.weight"  # [30, 12]: rows 0-14 in rank00000.bin, 15-29 in rank00001.bin


def app(cwd: Path, *overrides: str) -> None:
    proc = subprocess.run(
        [sys.executable, "train.py", *BASE, *overrides], cwd=cwd, env=env(), capture_output=True, text=True, timeout=300
    )
    if proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def ckpt(folder: Path, step: int) -> Path:
    return folder / "checkpoints" / mf.step_dir_name(step)


def flip_bit(path: Path, anchors: List[bytes], index: int, bit: int) -> None:
    """Flip one bit of the byte at `index` in the last of `anchors`, each found after the one before."""
    raw, at = bytearray(path.read_bytes()), 0
    for anchor in anchors:
        at = raw.index(anchor, at)
    raw[at + index] ^= bit
    path.write_bytes(bytes(raw))


def edit(path: Path, sealed: bool, change: Any) -> None:
    data = json.loads(path.read_text())
    change(data)
    if sealed:
        path.write_bytes(mf.seal(data))  # the digest made to match: only the check under test can tell
    else:
        path.write_text(json.dumps({k: v for k, v in data.items() if k != mf.DIGEST}, indent=1))  # an earlier version's


def overlapping(data: Dict[str, Any]) -> None:
    (first, _, shape), (second, offset, _) = data["tensors"][SPLIT]["pieces"]
    empty = [second, offset, [0, shape[1]]]
    data["tensors"][SPLIT]["pieces"] = [[first, [7, 0], shape], [second, [8, 0], shape]] + [empty] * 600


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    """The uninterrupted run (3 epochs, 60 steps) and a run of the blocks-reversed optimizer (its step 25)."""
    cwd = tmp_path_factory.mktemp("crafted") / "project"
    shutil.copytree(APP, cwd)
    app(cwd, "epochs=3", "run.name=ref")
    app(cwd, "epochs=2", "optimizer_order=blocks_reversed", "run.name=reversed")
    return {"cwd": cwd, "ref": run_dir(cwd, "ref"), "reversed": run_dir(cwd, "reversed")}


def test_crafted_checkpoints_are_named_set_aside_and_the_run_ends_exact(runs: Dict[str, Any]) -> None:
    cwd, folder = runs["cwd"], run_dir(runs["cwd"], "r")
    shutil.copytree(runs["ref"], folder)
    for junk in ("summary.json", ".steadfast.lock", "events.jsonl", "metrics.jsonl", "model.safetensors"):
        (folder / junk).unlink(missing_ok=True)
    for step in (45, 50, 55, 60):  # the run stopped at step 40
        shutil.rmtree(ckpt(folder, step))
    manifest = json.loads((ckpt(folder, 40) / mf.MANIFEST).read_text())
    assert mf.DIGEST in manifest and [p[0] for p in manifest["tensors"][SPLIT]["pieces"]] == ["rank00000.bin", "rank00001.bin"]
    assert [json.loads((ckpt(folder, s) / mf.MANIFEST).read_text())["commit"] for s in (5, 40)] == [1, 8]

    piece_file = [b'"tensors"', f'"{SPLIT}"'.encode(), b"rank00001.bin"]
    flip_bit(ckpt(folder, 40) / mf.MANIFEST, piece_file, 8, 0x01)
    flip_bit(ckpt(folder, 35) / mf.MANIFEST, piece_file, 8, 0x01)
    edit(ckpt(folder, 35) / mf.MANIFEST, sealed=False, change=lambda m: None)
    edit(ckpt(folder, 30) / mf.MANIFEST, sealed=True, change=overlapping)
    shutil.rmtree(ckpt(folder, 25))
    shutil.copytree(ckpt(runs["reversed"], 25), ckpt(folder, 25))
    flip_bit(ckpt(folder, 5) / mf.MANIFEST, [b'"commit"', b"1"], 0, 0x08)
    assert json.loads((ckpt(folder, 5) / mf.MANIFEST).read_text())["commit"] == 9  # the newest by commit now

    app(cwd, "epochs=3", "run.name=r")

    invalid = {e["step"]: e for e in events(folder) if e["event"] == "checkpoint_invalid"}
    assert sorted(invalid) == [5, 25, 30, 35, 40], invalid
    assert all(e["path"] == str(ckpt(folder, s)) for s, e in invalid.items())
    assert "digest does not match" in invalid[5]["error"] and "digest does not match" in invalid[40]["error"]
    assert "the manifest does not describe its files" in invalid[35]["error"] and SPLIT in invalid[35]["error"]
    assert "two pieces overlap" in invalid[30]["error"]
    assert "params[2] is model.blocks.0.norm.weight here, at param_groups[0].params[10]" in invalid[25]["error"]
    assert [e["step"] for e in events(folder) if e["event"] == "resumed"] == [20]
    assert sorted(e["step"] for e in events(folder) if e["event"] == "checkpoint_set_aside") == [5, 25, 30, 35, 40]
    got, ref = summary(folder), summary(runs["ref"])
    assert got["status"] == "completed" and got["global_step"] == ref["global_step"] == 60
    assert got["model_sha256"] == ref["model_sha256"]
