"""Text from a trained examples/charlm run (no launcher, no workers: one process):

    python -m examples.charlm.sample outputs/charlm_default
    python -m examples.charlm.sample outputs/charlm_default --prompt "def " --chars 400 --temperature 0.8

The model is rebuilt from the run's frozen config (config.yaml, plain YAML) and its weights and
vocabulary are read from the newest committed checkpoint that verifies (sizes and checksums
against its manifest; an older one if the newest is damaged). Nothing is unpickled.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch
from omegaconf import OmegaConf

from pipeline.models import CharTransformer
from pipeline.text import CharCorpus
from steadfast.checkpoint import manifest
from steadfast.checkpoint.consolidate import ConsolidateError, load_whole


def newest_state(folder: Path, names: Tuple[str, ...]) -> Tuple[int, Dict[str, Any]]:
    """The states `names` of the newest committed checkpoint in `folder` whose files verify (sharded
    or not: a sharded one's pieces are put together into whole tensors)."""
    problems: List[str] = []
    for c in manifest.scan(folder):
        try:
            return c.step, load_whole(c.path, names)
        except (OSError, ValueError, ConsolidateError) as exc:
            problems.append(f"{c.name}: {exc}")
    raise SystemExit(f"no usable checkpoint in {folder}" + (f" ({'; '.join(problems)})" if problems else ""))


def load(run_dir: Path) -> Tuple[CharTransformer, CharCorpus, int]:
    config = run_dir / "config.yaml"
    if not config.is_file():
        raise SystemExit(f"{config} not found: give the run folder of an examples/charlm run (outputs/charlm_...)")
    cfg = OmegaConf.load(config)
    folder = Path(cfg.checkpoint.dir) if cfg.checkpoint.get("dir") else run_dir / "checkpoints"
    step, states = newest_state(folder, ("model", "vocab"))
    chars = states["vocab"].get("chars") if isinstance(states["vocab"], dict) else None
    if not isinstance(chars, str) or not chars:
        raise SystemExit(f"{folder}: the checkpoint of step {step} holds no vocabulary")
    vocab = CharCorpus(text="", chars=chars, sha256=str(states["vocab"].get("sha256")))
    model = CharTransformer((int(cfg.data.block_size),), vocab.vocab_size, **OmegaConf.to_container(cfg.model))
    model.load_state_dict(states["model"])
    return model.eval(), vocab, step


def main(argv: List[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path, help="the run folder, e.g. outputs/charlm_default")
    p.add_argument("--prompt", default="import ", help="the text to continue")
    p.add_argument("--chars", type=int, default=300, help="how many characters to generate")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (a small model runs fastest on one)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, vocab, step = load(args.run_dir)
    try:
        prompt = vocab.encode(args.prompt).unsqueeze(0)
    except ValueError as exc:
        raise SystemExit(f"--prompt: {exc}") from None
    print(f"# {args.run_dir} (checkpoint step {step}), temperature {args.temperature}", file=sys.stderr, flush=True)
    out = model.generate(prompt, args.chars, args.temperature, args.top_k, torch.Generator().manual_seed(args.seed))
    print(vocab.decode(out[0].tolist()))


if __name__ == "__main__":
    main()
