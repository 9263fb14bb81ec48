"""Every numeric key of every schema is bounded (issue 32, findings 8 and 10): a value the workers
could not hold (NaN, an infinity, an integer past int64, seconds past timedelta) is refused by the
pre-flight naming the key; anything accepted builds what the workers build from it."""

from __future__ import annotations

import dataclasses
import math
import random
import typing
from datetime import timedelta
from typing import Any, Iterator, List, Tuple

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
