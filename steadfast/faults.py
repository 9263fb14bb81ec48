"""Fault injection: rehearse recovery before a long run (`fault=kill_rank`, `fault=hang_rank`, ...).

A fault fires on rank `fault.rank` when it completes step `fault.at_step` (`hang_in_backward`:
in the backward pass of that step; the save faults: in the first checkpoint written at or after
that step; only rank 0 writes), at most `fault.times` times over the whole run: the count is kept
in the run folder, so it survives restarts. Every firing is recorded in events.jsonl before it
happens.

kill            SIGKILL, as a crash or the OOM killer would
segfault        SIGSEGV, as a crash in native code would
hang            alive but stuck for `hang_s` (the launcher's watchdog finds it: restart.hang_timeout_s)
hang_in_backward, hang_in_save   the same, in the middle of the backward pass / of writing a checkpoint
exception       an exception in the training step
sigterm         SIGTERM to itself, as a scheduler's preemption notice: save, stop, exit code 75
crash_in_save   SIGKILL in the middle of writing a checkpoint
crash_in_snapshot  SIGKILL in the middle of copying a snapshot into shared memory
save_error      writing a checkpoint fails with ENOSPC (disk full)
corrupt_checkpoint  one byte of the newest committed checkpoint flipped after it is written
slow_rank       `delay_s` seconds more local work on every step from `at_step` on, for the rest of the
                run and its restarts (`times` does not apply): slept after the step boundary, before
                the next forward, where a slow data loader or slow compute would be; recorded once per attempt
nan_loss        the model's output NaN in the forward passes of step `at_step` (training only): a NaN
                loss, and gradients that poison every replica through the gradient all-reduce
loss_spike      the same, `factor` times standard normal noise added to the output: a loss spike and
                its large gradients
bitflip         bit `bit` of the first element of the first parameter flipped after step `at_step`: that
                replica silently differs from the others (steadfast/health/replicas.py finds it)

With `fault.hang_until_stop=true` a hang ends as soon as the process is asked to stop
(SIGTERM/SIGINT): tests use it to deliver a real signal at an exact moment.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from .config import FaultConf, FaultKind
from .contract.events import Event
from .contract.heartbeat import heartbeat

if TYPE_CHECKING:  # the launcher's pre-flight imports this module (WRITER_KINDS): no torch at import
    import torch

# The kinds (steadfast.config.FaultKind, their one definition) by how and where they fire.
KILLING = frozenset({FaultKind.kill, FaultKind.crash_in_save, FaultKind.crash_in_snapshot})  # SIGKILL: no last word
FAILING = KILLING | {FaultKind.segfault, FaultKind.exception, FaultKind.save_error}  # the attempt fails (its event says `fails`)
SAVE_KINDS = frozenset({FaultKind.crash_in_save, FaultKind.save_error, FaultKind.hang_in_save})  # in a checkpoint's writing
WRITER_KINDS = SAVE_KINDS | {FaultKind.corrupt_checkpoint}  # fire on a rank that writes checkpoint files
STEP_KINDS = frozenset(
    {FaultKind.kill, FaultKind.segfault, FaultKind.hang, FaultKind.exception, FaultKind.sigterm, FaultKind.bitflip}
)
FORWARD_KINDS = frozenset({FaultKind.nan_loss, FaultKind.loss_spike})  # in the model's forward pass
HANG_KINDS = frozenset({FaultKind.hang, FaultKind.hang_in_backward, FaultKind.hang_in_save})


class InjectedFault(RuntimeError):
    """Raised by fault=exception."""


class FaultInjector:
    def __init__(self, cfg: FaultConf, rank: int, run_dir: Path, record_event: Callable[..., None]) -> None:
        self.cfg, self.rank, self.record_event = cfg, rank, record_event
        self.kind = FaultKind(getattr(cfg.kind, "value", cfg.kind)) if cfg is not None else FaultKind.none
        self.active = self.kind is not FaultKind.none and cfg.rank == rank
        self.counter = run_dir / "faults" / f"{self.kind.value}-rank{rank}-step{cfg.at_step}.count" if self.active else None
        self._slowing = False  # fault=slow_rank: its firing recorded in this process
        self._poisoning = -1  # nan_loss, loss_spike: the step whose forward passes it fired in
        self.model: Optional[torch.nn.Module] = None  # bitflip: the model whose parameter it flips

    @property
    def wants_backward_hook(self) -> bool:
        return self.active and self.kind is FaultKind.hang_in_backward

    def watch(self, model: torch.nn.Module, next_step: Callable[[], int]) -> None:
        """run.setup's model: nan_loss and loss_spike act on its output in the step about to run
        (`next_step()`), bitflip on its first parameter."""
        self.model = model
        if self.active and self.kind in FORWARD_KINDS:
            model.register_forward_hook(lambda module, args, out: self.in_forward(next_step(), module, out))

    def in_forward(self, step: int, module: torch.nn.Module, output: object) -> Optional[torch.Tensor]:
        """A forward hook's: step `step`'s output made NaN (nan_loss), or `factor` times standard normal
        noise added to it (loss_spike: a loss far above its range whatever the loss function), in every
        training forward pass of that step (each micro-batch); None leaves the output as it is."""
        import torch

        if not (self.active and module.training and isinstance(output, torch.Tensor)):
            return None
        if step != self.cfg.at_step:
            self._poisoning = -1  # another step: a replay of at_step after a rollback claims anew
            return None
        if self._poisoning != step:
            if self.kind not in FORWARD_KINDS or not self._claim():
                return None
            self._poisoning = step
            self.record_event(Event.FAULT_FIRED, fault=self.kind.value, rank=self.rank, step=step, pid=os.getpid(), fails=False)
        if self.kind is FaultKind.nan_loss:
            return output * float("nan")
        noise = torch.randn(output.shape, generator=torch.Generator().manual_seed(step * 1_000_003 + self.rank))
        return output + self.cfg.factor * noise.to(output.device, output.dtype)

    def before_work(self, step: int) -> None:
        """At a step boundary, before step `step`'s local work (fault=slow_rank)."""
        if not (self.active and self.kind is FaultKind.slow_rank and step >= self.cfg.at_step):
            return
        if not self._slowing:
            self._slowing = True
            self.record_event(Event.FAULT_FIRED, fault=self.kind.value, rank=self.rank, step=step, pid=os.getpid(), fails=False)
        time.sleep(self.cfg.delay_s)

    def next_due(self, step: int) -> Optional[int]:
        """The step after `step` whose end `after_step` fires at (None: none)."""
        return self.cfg.at_step if self.active and self.kind in STEP_KINDS and self.cfg.at_step > step else None

    @property
    def slows(self) -> bool:
        """fault=slow_rank on this rank: `before_work` has work at every step boundary."""
        return self.active and self.kind is FaultKind.slow_rank

    def after_step(self, step: int) -> None:
        if self.active and step == self.cfg.at_step and self.kind in STEP_KINDS and self._claim():
            self._fire(step)

    def in_backward(self, step: int) -> None:
        """Called from a gradient hook while step `step` runs its backward pass."""
        if self.active and step == self.cfg.at_step and self.kind is FaultKind.hang_in_backward and self._claim():
            self._fire(step)

    def during_snapshot(self, step: int) -> None:
        """Called in the middle of copying the snapshot in memory of `step` (half of it is copied)."""
        if self.active and step >= self.cfg.at_step and self.kind is FaultKind.crash_in_snapshot and self._claim():
            self._fire(step)

    def during_save(self, step: int, files_written: int) -> None:
        """Called by the checkpoint writer after each file of the save at `step`."""
        if self.active and step >= self.cfg.at_step and files_written == 1 and self.kind in SAVE_KINDS and self._claim():
            self._fire(step)

    def after_commit(self, step: int, path: str) -> None:
        """fault=corrupt_checkpoint: damage the checkpoint just committed (flip the last byte of its largest file)."""
        if self.active and step >= self.cfg.at_step and self.kind is FaultKind.corrupt_checkpoint and self._claim():
            self.record_event(
                Event.FAULT_FIRED, fault=self.kind.value, rank=self.rank, step=step, path=str(path), pid=os.getpid()
            )
            from .checkpoint import manifest as mf

            files = mf.read(path)["files"]  # the largest file: the model's (or rank 0's, in the sharded format)
            largest = max(files, key=lambda name: files[name]["bytes"])
            with open(Path(path) / largest, "r+b") as f:  # a folder's checkpoint (the fault damages files on disk)
                f.seek(-1, os.SEEK_END)
                last = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last[0] ^ 0xFF]))

    def _claim(self) -> bool:
        """Count one firing, unless the configured number already fired (over all restarts)."""
        assert self.counter is not None
        self.counter.parent.mkdir(exist_ok=True)
        fired = int(self.counter.read_text()) if self.counter.exists() else 0
        if self.cfg.times and fired >= self.cfg.times:
            return False
        self.counter.write_text(str(fired + 1))
        return True

    def _fire(self, step: int) -> None:
        beat = heartbeat()
        if beat is not None:  # the step counted so far in the file now, not within PUBLISH_S: a killed rank is named at it
            beat.flush()
        from .telemetry.records import flush_rows  # here: the launcher's pre-flight imports this module, not the rows' thread

        flush_rows()  # the metrics rows read so far in metrics.jsonl, as when a row was the training thread's own write
        kind = self.kind
        flipped = next(self.model.named_parameters()) if kind is FaultKind.bitflip and self.model is not None else None
        where = {"tensor": flipped[0]} if flipped is not None else {}
        # Written straight to events.jsonl (not through rank 0) so any rank can report its fault.
        self.record_event(
            Event.FAULT_FIRED, fault=kind.value, rank=self.rank, step=step, pid=os.getpid(), fails=kind in FAILING, **where
        )
        if kind in KILLING:
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind is FaultKind.segfault:
            os.kill(os.getpid(), signal.SIGSEGV)
        elif kind is FaultKind.sigterm:
            os.kill(os.getpid(), signal.SIGTERM)
        elif kind is FaultKind.save_error:
            raise OSError(errno.ENOSPC, f"No space left on device (injected by fault=save_error at step {step})")
        elif kind is FaultKind.exception:
            raise InjectedFault(f"fault=exception injected at step {step} on rank {self.rank}")
        elif flipped is not None:
            flip_bit(flipped[1], self.cfg.bit)
        elif kind in HANG_KINDS:
            from .contract.stop import stop_requested

            deadline = time.monotonic() + self.cfg.hang_s
            while time.monotonic() < deadline:  # alive but making no progress
                if self.cfg.hang_until_stop and stop_requested() is not None:
                    break
                time.sleep(0.01)


def flip_bit(param: torch.Tensor, bit: int) -> None:
    """Flip bit `bit` (0: the lowest; modulo the element's width) of the first element of `param`."""
    import torch

    width = 8 * param.element_size()
    ints = {8: torch.uint8, 16: torch.int16, 32: torch.int32, 64: torch.int64}[width]
    bit %= width
    mask = (1 << bit) - (1 << width if bit == width - 1 and ints is not torch.uint8 else 0)  # the sign bit: negative
    with torch.no_grad():
        element = param.detach().reshape(-1)[:1].view(ints)
        element.bitwise_xor_(torch.tensor(mask, dtype=ints, device=element.device))
