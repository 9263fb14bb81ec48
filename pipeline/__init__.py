"""The built-in trainer: a Hydra app on the steadfast library (`python -m pipeline.train`)."""
