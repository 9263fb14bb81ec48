"""A character language model in your own training loop, on steadfast (run from the repository root):

    python -m examples.charlm.train                       # 2 torchrun workers; outputs/charlm_default/
    python -m examples.charlm.sample outputs/charlm_default   # text from the trained weights
    python -m examples.charlm.train parallel=fsdp accumulate=4   # sharded (FSDP2), 4 batches per step

The corpus (the Python standard library's own sources, about 1 MB, read at run time), its
windows and the transformer are the built-in trainer's (pipeline/text.py, pipeline/models.py:
`data=text model=transformer task=language_model` trains the same model without a loop of your
own); the loop, the optimizer and the validation are this file's. The vocabulary is checkpointed
with the weights, so a resume on a machine whose Python gives another text is refused, and
sample.py decodes with exactly the characters the model was trained on.

`parallel=fsdp` shards the transformer over the workers (run.setup applies FSDP2 to each layer and
the whole model; checkpoints are sharded: each worker writes its own pieces); `accumulate=N` adds
the gradients of N batches before each optimizer step (reduced over the workers on the N-th only).
"""

import math

import hydra
import torch
import torch.nn.functional as F

import steadfast as sf
from pipeline.models import CharTransformer
from pipeline.text import Vocabulary, load_corpus, split


@torch.no_grad()
def evaluate(run, model, val, batch_size=64):
    """Mean next-character loss over the validation windows: each rank takes an equal share."""
    model.eval()
    x_all, y_all = val.tensors
    mine = torch.arange(run.rank, len(x_all) // run.world_size * run.world_size, run.world_size)
    total = 0.0
    for start in range(0, len(mine), batch_size):
        run.beat("validate")
        idx = mine[start : start + batch_size]
        x, y = x_all[idx].to(run.device), y_all[idx].to(run.device)
        total += F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum").item()
    model.train()
    return run.mean(total / (len(mine) * y_all.shape[1]))


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg):
    with sf.Run(cfg, seed=cfg.seed, accumulate_grad_batches=cfg.accumulate) as run:
        corpus = load_corpus(cfg.data.max_chars)
        train, val = split(corpus, cfg.data.block_size, cfg.data.block_size, cfg.data.val_fraction)
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        net = CharTransformer((cfg.data.block_size,), corpus.vocab_size, **cfg.model)
        optimizer = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        model, optimizer = run.setup(net, optimizer)  # DDP, or FSDP2 with parallel=fsdp
        torch.manual_seed(cfg.seed + 1 + run.rank)  # each rank its own dropout stream
        loader = run.loader(train, batch_size=cfg.batch_size)
        run.resume(model=model, optimizer=optimizer, vocab=Vocabulary(corpus))
        for epoch in run.epochs(cfg.epochs):
            for x, y in loader:
                x, y = x.to(run.device), y.to(run.device)
                with run.accumulate(model):  # the gradients are reduced over the workers on a step's last batch
                    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                    (loss / cfg.accumulate).backward()
                if run.sync_gradients:
                    torch.nn.utils.clip_grad_norm_(net.parameters(), cfg.grad_clip)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    run.step(loss)
            train_loss = run.epoch_loss()  # None when a resume found every batch of this epoch done
            val_loss = evaluate(run, net, val)
            run.log(train_loss=train_loss, val_loss=val_loss, val_bits_per_char=val_loss / math.log(2))
            if run.is_main:
                print(
                    f"epoch {epoch + 1}/{cfg.epochs}: train loss {train_loss or float('nan'):.3f}, val loss {val_loss:.3f} "
                    f"({val_loss / math.log(2):.2f} bits per character)"
                )


if __name__ == "__main__":
    main()
