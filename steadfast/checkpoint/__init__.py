"""Checkpoints that are either committed and complete, or invisible.

The commit protocol and the resume:
  manager        CheckpointManager: save (synchronous or in the background), restore, retention
  retention      which checkpoints retention keeps (the newest, the best by a metric, ...): a pure rule
  restore        the one resume (the memory tier, then the store's checkpoints); every check that makes
                 a bad one "unusable, fall back"
  manifest       what makes a checkpoint committed, listing them, which config changes a resume
                 accepts (cheap, no torch: the launcher's pre-flight uses it)
  staging        the blocking part of an asynchronous save: the tensors copied into reused host memory
  ranks          one rank's part of a save: the files its codec planned for it, written; its report to rank 0
  optimizers     whether a saved optimizer state fits the live optimizer (parameters by name, shapes, placements)
  storage        where a checkpoint's bytes go: the Store interface (stage, write, commit, list, read, set
                 aside, discard), a folder (posix, fileio: whole, checked writes), an S3 bucket (s3)
The format (what the files hold):
  codec          Codec, the extension point: what each rank writes and how it gets its state back;
                 `register`, what a codec's module ends with
  formats        the codecs there are (the built-in ones imported); which one stores a state, which
                 one wrote a checkpoint
  formatspec     a format as the manifest knows it (no torch): its number, name and the check of its
                 own manifest fields; the registry the manifest's validation asks
  replicated     the replicated format: the same state on every rank, written once by rank 0
  replicated_spec   its formats' specs (4, and 2: read only; no torch)
  sharded        the sharded format: every rank writes its own pieces of the DTensors
  shard_reader   the sharded format's reader: each rank's own pieces, or whole tensors
  piecetable     the sharded format's spec (no torch) and its tables of pieces: the manifest's (checked
                 to cover every tensor exactly), each rank file's own
  shards         where a rank's piece lies in the whole tensor; a piece built from others' pieces
  sources        where a checkpoint's bytes are read from: a store's Files, or a snapshot's buffers
  tensorformat   the tensor file format (safetensors plus the state's skeleton), shared by
  tensorwrite    its writer (a Layout first, then the bytes straight from the tensors' memory) and
  tensorfile     its reader (nothing unpickled), and the public names of both
  reuse          a file's layout planned once and reused while the state keeps its structure
  dtypes         the format's dtype codes and the torch dtypes they name (no torch)
  export, consolidate   one plain safetensors file of a model: from a live sharded model, and
                 `steadfast-consolidate` from a committed checkpoint
  finite         a poisoned state (a NaN or an infinity) is never committed, nor resumed
  compare        two checkpoints of one step read whole and compared object by object, key by key
                 (steadfast-verify: where a resumed run left the path of the run never stopped)
What a run's loop tracks, on top of those:
  tracked        Checkpointer: the objects a checkpoint holds, the resume policy, each save's bookkeeping
  state          Stateful, PerRank, Progress, RNG states, model_sha256
  memory         the memory tier: copies of the state in /dev/shm between checkpoints
  shared_folder  whether every rank sees the run folder rank 0 writes to
"""

from __future__ import annotations

from . import piecetable, replicated_spec  # noqa: F401  (the built-in formats' specs: the manifest reads them, no torch)
