"""A loop with a compiled model (tests/loop/test_compile.py): nanoGPT's order, `torch.compile` then
`run.setup` (DDP). Rank 0 prints one line per attempt after its first step: the graph breaks Dynamo
counted and the compile caches it hit and missed."""

import json
import os

import hydra
import torch
import torch._dynamo.utils
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import steadfast as sf


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg):
    with sf.Run(cfg, seed=cfg.seed) as run:
        torch.manual_seed(cfg.seed)
        g = torch.Generator().manual_seed(1234)
        x = torch.randn(cfg.samples, 20, generator=g)
        data = TensorDataset(x, (x @ torch.randn(20, 4, generator=g)).argmax(1))
        model = torch.compile(nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 4)), backend=cfg.backend_compiler)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = run.setup(model, optimizer)
        loader = run.loader(data, batch_size=32)
        run.resume(model=model, optimizer=optimizer)
        reported = False
        for _ in run.epochs(cfg.epochs):
            for xb, yb in loader:
                optimizer.zero_grad()
                loss = F.cross_entropy(model(xb.to(run.device)), yb.to(run.device))
                loss.backward()
                optimizer.step()
                run.step(loss)
                if not reported and run.is_main:
                    reported = True
                    counters = torch._dynamo.utils.counters  # torch's own, read at run time
                    line = {
                        "graph_breaks": sum(counters["graph_break"].values()),
                        "hits": counters["aot_autograd"]["autograd_cache_hit"],
                        "misses": counters["aot_autograd"]["autograd_cache_miss"],
                        "cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
                    }
                    print("COMPILED " + json.dumps(line), flush=True)
        return run.finish()


if __name__ == "__main__":
    main()
