"""The guides cannot rot: the own-loop guide's app runs for real, the code the README shows is that
app's, the diff shown of examples/seed is the current one, and every link between the documents
points at a file and a heading that exist.

docs/own-loop.md marks the fenced blocks that make up its app with an HTML comment right before
each, `<!-- file: PATH -->`; the README marks its excerpt of that app with
`<!-- excerpt: docs/own-loop.md PATH -->`.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
from omegaconf import OmegaConf

from helpers import ROOT, env, events, run_dir, summary

GUIDE = ROOT / "docs" / "own-loop.md"
FILE_BLOCK = re.compile(r"^<!-- file: (\S+) -->\n```[\w-]*\n(.*?)^```$", re.M | re.S)
EXCERPT_BLOCK = re.compile(r"^<!-- excerpt: (\S+) (\S+) -->\n```[\w-]*\n(.*?)^```$", re.M | re.S)
DIFF_BLOCK = re.compile(r"^```diff\n(.*?)^```$", re.M | re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples" / "README.md", ROOT / "BENCHMARKS.md"]


def marked_files(document: Path) -> Dict[str, str]:
    """The blocks of `document` marked `<!-- file: PATH -->`, by PATH."""
    found: Dict[str, str] = {}
    for path, text in FILE_BLOCK.findall(document.read_text()):
        assert path not in found, f"{document.name}: two blocks marked {path}"
        found[path] = text
    return found


def headings(document: Path) -> List[str]:
    """GitHub's anchors for the headings of a Markdown file (outside fenced code)."""
    anchors: List[str] = []
    seen: Dict[str, int] = {}
    fenced = False
    for line in document.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            anchors.append(f"{slug}-{seen[slug]}" if slug in seen else slug)  # a repeated heading gets -1, -2, ...
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_the_guide_marks_a_complete_app() -> None:
    files = marked_files(GUIDE)
    assert set(files) == {"train.py", "conf/config.yaml"}, files.keys()
    compile(files["train.py"], "train.py", "exec")
    config = OmegaConf.create(files["conf/config.yaml"])
    assert "steadfast" in config.defaults and "pkg://steadfast.conf" in config.hydra.searchpath


def test_the_readme_shows_the_guides_code() -> None:
    (excerpt,) = EXCERPT_BLOCK.findall((ROOT / "README.md").read_text())
    source, path, shown = excerpt
    whole = marked_files(ROOT / source)[path].splitlines()
    lines = shown.rstrip("\n").splitlines()
    assert len(lines) >= 10
    starts = [i for i in range(len(whole) - len(lines) + 1) if whole[i : i + len(lines)] == lines]
    assert starts, f"the README's code is not a verbatim part of {path} in {source}"


@pytest.mark.skipif(shutil.which("diff") is None, reason="needs diff(1)")
def test_the_diff_shown_of_the_seed_example_is_current() -> None:
    plain, converted = "examples/seed/train_plain.py", "examples/seed/train.py"
    current = subprocess.run(
        ["diff", "-u", "--label", plain, "--label", converted, plain, converted], cwd=ROOT, capture_output=True, text=True
    ).stdout
    (shown,) = DIFF_BLOCK.findall(GUIDE.read_text())
    assert shown == current, "docs/own-loop.md shows an old diff: paste `diff -u --label ... --label ...` again"


def test_links_between_the_documents_resolve() -> None:
    broken = []
    for document in DOCUMENTS:
        text = re.sub(r"^```.*?^```$", "", document.read_text(), flags=re.M | re.S)  # links in code are not links
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (document.parent / path).resolve() if path else document
            if not file.exists():
                broken.append(f"{document.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in headings(file):
                broken.append(f"{document.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


@pytest.mark.slow
def test_the_guides_app_trains_and_resumes(tmp_path: Path) -> None:
    """The guide's two blocks, copied into a folder outside the repository, run as the guide says:
    `python train.py` (2 torchrun workers); the same command again resumes and trains nothing."""
    app = tmp_path / "my_project"
    assert ROOT not in app.parents
    for path, text in marked_files(GUIDE).items():
        (app / path).parent.mkdir(parents=True, exist_ok=True)
        (app / path).write_text(text)
    epochs = OmegaConf.load(app / "conf" / "config.yaml").epochs

    def launch() -> dict:
        proc = subprocess.run([sys.executable, "train.py"], cwd=app, env=env(), capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-6000:]}"
        return summary(run_dir(app, "own_default"))

    first = launch()
    assert first["status"] == "completed" and first["world_size"] == 2, first
    assert first["epochs_completed"] == epochs and first["global_step"] > 0 and first["resumed_from_step"] is None, first
    assert first["final_loss"] is not None, first

    second = launch()
    assert second["status"] == "completed", second
    assert second["resumed_from_step"] == second["global_step"] == first["global_step"], second
    assert second["model_sha256"] == first["model_sha256"]
    records = events(run_dir(app, "own_default"))
    assert sum(e["event"] == "first_step" for e in records) == 1, "the second launch trained a step"
    assert [e["step"] for e in records if e["event"] == "resumed"] == [first["global_step"]]
