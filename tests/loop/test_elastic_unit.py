"""Elastic resumes: the data position in samples survives a change of world size and batch size."""

from __future__ import annotations

import itertools

from steadfast.loop.data import ResumableSampler


def _take(samplers, batches, batch_size):
    """What the ranks read in `batches` steps (each rank `batch_size` per step), all ranks together."""
    out = []
    iters = [iter(s) for s in samplers]
    for _ in range(batches):
        for it in iters:
            out += list(itertools.islice(it, batch_size))
    return out


def test_same_world_size_resume_reads_exactly_the_uninterrupted_order() -> None:
    whole = [list(ResumableSampler(103, 2, r, seed=3, batch_size=4)) for r in range(2)]
    resumed = []
    for r in range(2):
        s = ResumableSampler(103, 2, r, seed=3, batch_size=4)
        s.start(0, 5 * 4 * 2)
        resumed.append(list(s))
    assert [w[20:] for w in whole] == resumed


def test_resharding_mid_epoch_neither_repeats_nor_skips() -> None:
    total = 103
    first = [ResumableSampler(total, 2, r, seed=3, batch_size=4) for r in range(2)]
    read = _take(first, 5, 4)  # 5 steps on 2 workers: 40 samples
    position = 5 * first[0].samples_per_step
    assert position == 40
    after = []
    for r in range(3):  # a third worker joined; keep_global_batch would give each ceil(8/3) = 3
        s = ResumableSampler(total, 3, r, seed=3, batch_size=3)
        s.start(0, position)
        after.append(s)
    rest = _take(after, after[0].batches_left, 3)
    both = read + rest
    assert len(both) == len(set(both)), "a sample was read twice"
    missing = set(range(total)) - set(both)
    assert len(missing) < 3, "more than world_size - 1 samples were skipped"
    # and shrinking back to one worker continues from there too
    solo = ResumableSampler(total, 1, 0, seed=3, batch_size=8)
    solo.start(0, position)
    assert len(set(read) | set(solo)) == total and not set(read) & set(solo)


def test_a_resume_on_another_world_size_at_an_epochs_end_records_the_batch_size() -> None:
    """A checkpoint at an epoch's last step leaves its sampler with nothing left (len 0): the event
    still says each worker's batch and the global batch."""
    from steadfast.checkpoint.state import Progress
    from steadfast.loop.data import RunData

    progress = Progress(epoch=3, batch_in_epoch=26, sample_in_epoch=103)
    data = RunData(world_size=2, rank=0, seed=3, progress=progress, accumulate=1)
    data.loader(list(range(103)), batch_size=4, shuffle=True)
    assert len(data.samplers[0]) == 0
    recorded: list = []
    data.world_size_changed(lambda kind, **fields: recorded.append(fields), 80, 1, {})
    assert recorded[0]["batch_per_worker"] == 4 and recorded[0]["global_batch"] == 8
