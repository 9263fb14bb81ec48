"""The step loop's boundary and what is due at it (modules imported by `steadfast.Run`):

boundary        StepBoundary: what each part has due at a step (as a value), and the steps that
                only count
cadence         Cadence: when the disk tier saves (epochs, steps, seconds, or `auto`); history
agreement       StopAgreement: every rank stops at the same step
memory_cadence  MemoryCadence: when the memory tier copies (snapshot.every_n_steps, auto)
data            ResumableSampler, RunData: data that resumes exactly, for any world size
streams         Sources: a loop of steps' random batches and iterable data, positioned by what
                the steps took (a batch fetched ahead of the step is drawn again after a resume)
shape           LoopShape: epochs or steps, the loop's bound and where it stands in its own terms
stop            Stops: a stop on purpose, every rank at the same step: committed, recorded, StopRun
"""
