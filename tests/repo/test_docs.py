"""The guides cannot rot: the own-loop guide's app runs for real, the code the README shows is that
app's, the diff shown of examples/seed is the current one, and every link between the documents
points at a file and a heading that exist.

docs/own-loop.md marks the fenced blocks that make up its app with an HTML comment right before
each, `<!-- file: PATH -->`; a document marks an excerpt of that app with
`<!-- excerpt: docs/own-loop.md PATH -->`, and of a file of the repository with
`<!-- excerpt: PATH -->`. An excerpt is verbatim; a line `...` in it stands for lines left out.
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

from helpers import GUIDE, ROOT, env, events, marked_files, run_dir, summary

EXCERPT_BLOCK = re.compile(r"^<!-- excerpt: (\S+) ?(\S*) -->\n```[\w-]*\n(.*?)^```$", re.M | re.S)
DIFF_BLOCK = re.compile(r"^```diff\n(.*?)^```$", re.M | re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples" / "README.md", ROOT / "BENCHMARKS.md"]


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


def _is_part_of(shown: str, whole: List[str]) -> bool:
    """Whether `shown`'s lines appear in `whole` verbatim and in order, a `...` line standing for any lines."""
    chunks: List[List[str]] = [[]]
    for line in shown.rstrip("\n").splitlines():
        if line.strip() == "...":
            chunks.append([])
        else:
            chunks[-1].append(line)
    at = 0
    for chunk in (c for c in chunks if c):
        found = next((i for i in range(at, len(whole) - len(chunk) + 1) if whole[i : i + len(chunk)] == chunk), None)
        if found is None:
            return False
        at = found + len(chunk)
    return True


def test_the_code_the_documents_show_is_the_apps() -> None:
    excerpts = [(doc, *e) for doc in (ROOT / "README.md", GUIDE) for e in EXCERPT_BLOCK.findall(doc.read_text())]
    assert [(d.name, source, path) for d, source, path, _ in excerpts] == [
        ("README.md", "docs/own-loop.md", "train.py"),
        ("README.md", "examples/nanogpt/train.py", ""),
        ("own-loop.md", "examples/nanogpt/train.py", ""),
    ]
    for document, source, path, shown in excerpts:
        whole = (marked_files(ROOT / source)[path] if path else (ROOT / source).read_text()).splitlines()
        assert len(shown.splitlines()) >= 10
        assert _is_part_of(shown, whole), f"{document.name}: its code is not a verbatim part of {source} {path}"


def test_a_changed_line_is_not_part_of_the_app() -> None:
    whole = ["a", "b", "c", "d"]
    assert _is_part_of("a\n...\nc\nd\n", whole) and _is_part_of("b\nc\n", whole)
    assert not _is_part_of("a\nc\n", whole) and not _is_part_of("c\n...\na\n", whole)


@pytest.mark.skipif(shutil.which("diff") is None, reason="needs diff(1)")
def test_the_diff_shown_of_the_seed_example_is_current() -> None:
    plain, converted = "examples/seed/train_plain.py", "examples/seed/train.py"
    current = subprocess.run(
        ["diff", "-u", "--label", plain, "--label", converted, plain, converted], cwd=ROOT, capture_output=True, text=True
    ).stdout
    (shown,) = [d for d in DIFF_BLOCK.findall(GUIDE.read_text()) if d.startswith(f"--- {plain}\n")]
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
