"""BENCHMARKS.md's rows and section 6, Horovod against torchrun (bench.horovod); bench/report.py calls these."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from .cells import f, foreign_note, reported, table, target


def rows(hv: Optional[Dict[str, Any]]) -> List[List[str]]:
    rows: List[List[str]] = []
    if hv and not hv.get("skipped"):
        v = hv["ratios"].get("horovod/torchrun steps_per_s")
        rows.append(target("6", "Horovod / torchrun: steps/s (default settings)", v, ">=", 0.95))
        for k in hv.get("variants", {}):
            if k != "horovod" and f"{k}/torchrun steps_per_s" in hv["ratios"]:
                settings = ", ".join(f"{a}={b}" for a, b in hv["variants"][k].items())
                rows.append(reported("6", f"the same, `{k}` ({settings})", f(hv["ratios"][f"{k}/torchrun steps_per_s"], 2)))
        rows.append(reported("6", "Horovod / torchrun: time to first step", f(hv["ratios"].get("horovod/torchrun ttfs"), 2)))
    return rows


def section(hv: Optional[Dict[str, Any]]) -> List[str]:
    lines: List[str] = []
    if hv:
        lines += ["## 6. Horovod vs torchrun", ""]
        if hv.get("skipped"):
            lines += [f"Skipped: {hv['skipped']}.", ""]
        else:
            lines += [
                f"The hot-loop job with {hv['job']['steps_per_epoch']} steps per worker, `backend=horovod` (Gloo controller) vs the default torchrun backend, {hv['rounds']} alternated rounds."
                " Horovod's settings come from the launcher's environment for the variants (a value there wins over the backend's own)."
                + foreign_note(*(hv.get("foreign_load") or {}).values()),
                "",
            ]
            cpu = hv.get("cpu_s_per_step", {})
            lines += table(
                ["run", "settings", "steps/s", "/ torchrun", "CPU ms per step", "time to first step (s)", "wall (s)"],
                [
                    [
                        k,
                        ", ".join(f"{a}={b}" for a, b in (hv.get("variants", {}).get(k) or {}).items()) or "defaults",
                        f(hv["steps_per_s"][k]["median"], 1),
                        f(hv["ratios"].get(f"{k}/torchrun steps_per_s"), 2) if k != "torchrun" else "1",
                        f((cpu.get(k, {}).get("median") or 0) * 1e3, 2),
                        f(hv["ttfs_s"][k]["median"], 2),
                        f(hv["wall_s"][k]["median"], 1),
                    ]
                    for k in hv["steps_per_s"]
                ],
            )
    return lines
