"""Checkpoints that are either committed and complete, or invisible.

manager (CheckpointManager: save, restore, retention), restore (which checkpoint a resume uses),
snapshot (the blocking part of an asynchronous save), manifest (cheap, no torch: the launcher's
pre-flight uses it), fileio (whole writes, validated reads; no torch), and the tensor file format:
tensorformat (safetensors plus the state's skeleton), tensorwrite (writing), tensorfile (reading,
and the public names of both)."""
