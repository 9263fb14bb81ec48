"""Checkpoints that are either committed and complete, or invisible.

manager (CheckpointManager: save, restore, retention), restore (which checkpoint a resume uses),
snapshot (the blocking part of an asynchronous save), manifest (cheap, no torch: the launcher's
pre-flight uses it), fileio (whole writes, validated reads; no torch), and the tensor file format:
tensorformat (safetensors plus the state's skeleton), tensorwrite (writing), tensorfile (reading,
and the public names of both).

What a run's loop tracks, on top of those: tracked (Checkpointer: the objects a checkpoint holds,
the resume policy, each save's bookkeeping), state (Stateful, PerRank, Progress, RNG states,
model_sha256), memory (the memory tier: copies of the state in /dev/shm between checkpoints),
shared_folder (whether every rank sees the run folder rank 0 writes to).
"""
