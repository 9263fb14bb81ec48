"""Every numeric key of every schema is bounded (issue 32, findings 8 and 10): a value the workers
could not hold (NaN, an infinity, an integer past int64, seconds past timedelta) is refused by the
pre-flight naming the key; anything accepted builds what the workers build from it."""

from __future__ import annotations

import dataclasses
import math
import random
import typing
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, List, Tuple

import torch

from pipeline import config as pconf
from steadfast import config as sconf
from steadfast.contract import schemas
from steadfast.contract.schemas import bounded

DRAWS = [0, 1, -1, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 10**20, 1e300, -1e300, math.inf, -math.inf, math.nan, 0.5]

SCHEMAS: List[type] = [
    schemas.RestartConf,
    schemas.ClusterConf,
    sconf.CheckpointConf,
    sconf.FaultConf,
    sconf.LoggerConf,
    sconf.MlflowConf,
    sconf.SnapshotConf,
    sconf.AnomalyConf,
    pconf.TrainerConfig,
    *pconf.MODEL_SCHEMAS.values(),
    *pconf.DATA_SCHEMAS.values(),
]


def numeric_fields(schema: type) -> Iterator[Tuple[str, Any]]:
    """(field name, annotation) of each int or float field, discovered from the dataclass."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        args = typing.get_args(hints[f.name]) or (hints[f.name],)
        if any(a in (int, float) for a in args) or hints[f.name] is Any:
            yield f.name, hints[f.name]


def test_every_numeric_key_is_refused_or_holdable() -> None:
    rng = random.Random(32)
    seen = 0
    for schema in SCHEMAS:
        for name, _ in numeric_fields(schema):
            for value in DRAWS + [rng.uniform(-1e20, 1e20), rng.randint(-(2**70), 2**70)]:
                node = schema(**{name: value})
                problems = bounded("g", node)
                seen += 1
                if problems:
                    assert len(problems) == 1 and problems[0].startswith(f"g.{name}=") and "not allowed" in problems[0]
                    continue
                if isinstance(value, float):
                    timedelta(seconds=value)  # what the timeouts and cadences are built from
                else:
                    torch.tensor([value], dtype=torch.int64)  # what counts and steps are put in
    assert seen > 100


def test_finding_8_and_10_values_name_their_key() -> None:
    assert bounded("trainer", pconf.TrainerConfig(accumulate_grad_batches=10**20))[0].startswith(
        "trainer.accumulate_grad_batches=100000000000000000000 is not allowed"
    )
    assert schemas.RestartConf(collective_timeout_s=math.inf).problems()[0].startswith("restart.collective_timeout_s=inf")
    for group, conf, key in (
        ("checkpoint", sconf.CheckpointConf(every_n_seconds="nan"), "every_n_seconds"),
        ("logger", sconf.LoggerConf(progress_every_s=math.nan), "progress_every_s"),
        ("logger", sconf.LoggerConf(straggler_margin=math.nan), "straggler_margin"),
        ("fault", sconf.FaultConf(delay_s=math.nan), "delay_s"),
    ):
        assert bounded(group, conf)[0].startswith(f"{group}.{key}=")


# ---- every key of every schema, values of any type, through the checks the launch side runs ----------
def _launcher_schema() -> type:
    from hydra_plugins.steadfast_launcher.config import SteadfastLauncherConf

    return SteadfastLauncherConf


def _checked() -> List[Tuple[type, str, Callable[[Any], List[str]]]]:
    """(schema, the key prefix its problems name, the check the launch side runs on it before any worker starts)."""
    from hydra_plugins.steadfast_launcher import _backends  # noqa: F401  (registers every backend)
    from steadfast.contract import backends

    own: List[Tuple[type, str, Callable[[Any], List[str]]]] = [
        (schemas.RestartConf, "restart", lambda c: c.problems()),
        (schemas.ClusterConf, "cluster", lambda c: c.problems()),
        (_launcher_schema(), "hydra.launcher", lambda c: c.problems()),
        *[(s.schema, "backend", lambda c: c.problems()) for s in backends.specs()],
    ]
    library = [sconf.CheckpointConf, sconf.FaultConf, sconf.LoggerConf, sconf.SnapshotConf, sconf.ParallelConf, sconf.RunConf]
    group = {sconf.ParallelConf: "parallel", sconf.RunConf: "run", sconf.CheckpointConf: "checkpoint", sconf.FaultConf: "fault"}
    group.update({sconf.LoggerConf: "logger", sconf.SnapshotConf: "snapshot"})
    for schema in library:  # the library's pre-flight (preflight.check) bounds them first, then checks its rules
        own.append((schema, group[schema], lambda c, g=group[schema]: bounded(g, c)))
    return own


SECONDS = ("_s", "timeout")  # an integer of seconds is built into a timedelta
BASE = {sconf.RunConf: {"name": "r"}, schemas.ClusterConf: {"name": "slurm"}}  # cluster=none checks nothing: unused


def _draws(rng: random.Random) -> List[Any]:
    return [
        *DRAWS,
        rng.uniform(-1e20, 1e20),
        rng.randint(-(2**70), 2**70),
        "abc",
        "",
        "1e400",
        True,
        None,
        [1, "x"],
        {"k": 1},
    ]


def test_every_key_of_every_schema_is_refused_naming_it_or_holds() -> None:
    """Random values of any type for every key of the backend, parallel, run, launcher, restart,
    cluster and library schemas, put through OmegaConf's typed merge (how Hydra builds them) and then
    the schema's own checks: either refused with a message that names the key, or a value the code
    consuming it can hold (an int64, a timedelta for seconds)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    rng = random.Random(34)
    seen = refused = 0
    for schema, prefix, check in _checked():
        for f in dataclasses.fields(schema):
            if f.name.startswith("_"):
                continue
            key = f"{prefix}.{f.name}"
            for value in _draws(rng):
                seen += 1
                try:
                    node = OmegaConf.merge(OmegaConf.structured(schema), BASE.get(schema, {}), {f.name: value})
                    conf = OmegaConf.to_object(node)
                except (OmegaConfBaseException, ValueError):  # a wrong type: Hydra's "Error merging override <key>=..."
                    refused += 1
                    continue
                problems = check(conf)
                if problems:
                    refused += 1
                    assert problems[0].startswith((f"{key}=", f"{key} ")) or f"{key}=" in problems[0], (key, value, problems)
                    continue
                held = getattr(conf, f.name)
                if isinstance(held, bool) or not isinstance(held, (int, float)):
                    continue
                if isinstance(held, float) or f.name.endswith(SECONDS):
                    timedelta(seconds=held)
                if isinstance(held, int):
                    torch.tensor([held], dtype=torch.int64)
    assert seen > 500 and refused > 100, (seen, refused)


def test_a_bad_number_on_the_command_line_fails_in_one_line_before_any_worker_starts(tmp_path: Path) -> None:
    """Nine quintillion seconds fit an int64 but no timeout: torch elastic's rendezvous raised
    OverflowError once the launch was under way (its folder, events and logs made), naming no key.
    Now the pre-flight refuses it, naming the key, and nothing is started."""
    from helpers import run_dir, run_train

    proc = run_train(tmp_path, "backend.rdzv_last_call_s=9223372036854775807", "run.name=r", timeout=120)
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[0].startswith("Invalid config: backend.rdzv_last_call_s=9223372036854775807 is not allowed: seconds"), lines
    folder = run_dir(tmp_path, "r")
    started = [p for p in ("logs/rank0.log", "logs/rank1.log", "heartbeats", "events.jsonl") if (folder / p).exists()]
    assert not started, f"a worker started: {started}"
