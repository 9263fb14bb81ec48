"""Checkpoints that are either committed and complete, or invisible (manager), their manifests (manifest: cheap,
no torch, used by the launcher's pre-flight) and the tensor file format (tensorfile)."""
