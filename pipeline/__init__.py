"""The built-in trainer: a Hydra app on the steadfast library (`python -m pipeline.train`).

train            the entry point: Hydra composes the config, the steadfast launcher runs it
trainer          the loop: one client of `steadfast.Run`, written as a user would write theirs
config, conf     the trainer's config schemas and pre-flight check; its config (train.yaml, groups)
models, data     built-in models and datasets, built from their config
tasks            what is optimised and measured (`task=...`)
registry         a builder by `name` (built-ins) or by `_target_` (your own code)
text             a character-level corpus every machine has offline (the standard library's sources)
world_size       a resume on another number of workers: the batch size and the learning rate
help             `--help`: the app's config groups and their options
report, verify_recovery   `python -m pipeline.report`, `python -m pipeline.verify_recovery`
"""
