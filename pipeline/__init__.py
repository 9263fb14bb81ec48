"""The worker side: what runs on every rank (training, checkpoints, records)."""
