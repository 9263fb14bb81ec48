"""nanoGPT's train.py as people write it, on steadfast (run from the repository root):

    python -m examples.nanogpt.train                  # 2 torchrun workers; outputs/nanogpt_default/
    steadfast-verify --app examples.nanogpt.train     # killed and resumed against uninterrupted: the same weights?

Its shape is nanoGPT's: `max_iters` optimizer steps and no epochs, random batches drawn with
`torch.randint` from a uint16 memmap of tokens, the learning rate set from the iteration (warm-up,
cosine decay), gradient accumulation, the next batch fetched before the backward pass of the last
micro-batch (so it lives across the step boundary), the evaluation on rank 0 alone. The tokens are
the characters of the Python standard library's own sources (the first `data.max_chars`, written
to `data.dir` once, as nanoGPT's prepare.py writes train.bin and val.bin); the model is the
character transformer of pipeline/models.py (nanoGPT's layout).

What changed against the plain script is in docs/own-loop.md ("State the library cannot see"):
the data lines (`get_batch` takes a generator; the training batches come from
`run.random_batches`, so the batch fetched ahead is drawn again, the same, after a resume) and
the loop's frame (`run.steps`, `run.accumulate`, `run.step`). No state is tracked by hand: the
iteration is run.steps' count, the random streams are the run's.
"""

import json
import math
import os

import hydra
import numpy as np
import torch
import torch.nn.functional as F

import steadfast as sf
from pipeline.models import CharTransformer
from pipeline.text import load_corpus


def prepare(data_dir, max_chars, val_fraction):
    """train.bin and val.bin (uint16 token ids) and meta.json, written once (each file atomically:
    every rank may write them at the same time)."""
    meta_path = os.path.join(data_dir, "meta.json")
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        if meta["max_chars"] == max_chars:
            return meta
    corpus = load_corpus(max_chars)
    ids = corpus.encode(corpus.text).numpy().astype(np.uint16)
    cut = int(len(ids) * (1 - val_fraction))
    os.makedirs(data_dir, exist_ok=True)
    meta = {"max_chars": max_chars, "vocab_size": corpus.vocab_size, "sha256": corpus.sha256}
    for name, data in (
        ("train.bin", ids[:cut].tobytes()),
        ("val.bin", ids[cut:].tobytes()),
        ("meta.json", json.dumps(meta).encode()),
    ):
        tmp = os.path.join(data_dir, f".{name}.{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, os.path.join(data_dir, name))
    return meta


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg):
    meta = prepare(cfg.data.dir, cfg.data.max_chars, cfg.data.val_fraction)
    block_size, batch_size = cfg.block_size, cfg.batch_size
    with sf.Run(cfg, seed=cfg.seed, accumulate_grad_batches=cfg.gradient_accumulation_steps) as run:
        device = run.device

        def get_batch(split, generator=None):  # nanoGPT's, with generator= (None: the global RNG)
            data = np.memmap(os.path.join(cfg.data.dir, f"{split}.bin"), dtype=np.uint16, mode="r")
            ix = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
            x = torch.stack([torch.from_numpy(data[i : i + block_size].astype(np.int64)) for i in ix])
            y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + block_size].astype(np.int64)) for i in ix])
            return x.to(device), y.to(device)

        def get_lr(it):  # linear warm-up, then cosine decay to min_lr
            if it < cfg.warmup_iters:
                return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
            if it > cfg.lr_decay_iters:
                return cfg.min_lr
            ratio = (it - cfg.warmup_iters) / (cfg.lr_decay_iters - cfg.warmup_iters)
            return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)

        @torch.no_grad()
        def estimate_loss():  # rank 0 alone, its batches from the global RNG (saved with every checkpoint)
            out = {}
            raw_model.eval()
            for split in ("train", "val"):
                losses = torch.zeros(cfg.eval_iters)
                for k in range(cfg.eval_iters):
                    X, Y = get_batch(split)
                    losses[k] = F.cross_entropy(raw_model(X).flatten(0, 1), Y.flatten()).item()
                out[split] = losses.mean().item()
            raw_model.train()
            return out

        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        raw_model = CharTransformer((block_size,), meta["vocab_size"], **cfg.model)
        optimizer = torch.optim.AdamW(raw_model.parameters(), lr=cfg.learning_rate, betas=(0.9, 0.99), weight_decay=0.1)
        model, optimizer = run.setup(raw_model, optimizer)  # DDP on torchrun
        train_batches = run.random_batches(get_batch, "train")  # this rank's stream, where the steps left it
        run.resume(model=model, optimizer=optimizer)
        X, Y = next(train_batches)  # fetch the very first batch
        for iter_num in run.steps(cfg.max_iters):
            lr = get_lr(iter_num)
            for param_group in optimizer.param_groups:
                param_group["lr"] = lr
            if iter_num % cfg.eval_interval == 0 and run.is_main:
                losses = estimate_loss()
                print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
                run.log(val_loss=losses["val"], train_loss_estimate=losses["train"])
            for _micro_step in range(cfg.gradient_accumulation_steps):
                with run.accumulate(model):  # the gradients are reduced over the workers on the last micro-step
                    logits = model(X)
                    loss = F.cross_entropy(logits.flatten(0, 1), Y.flatten()) / cfg.gradient_accumulation_steps
                    X, Y = next(train_batches)  # fetch the next batch while this one's backward is to come
                    loss.backward()
            torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            run.step(loss * cfg.gradient_accumulation_steps)


if __name__ == "__main__":
    main()
