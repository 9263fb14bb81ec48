"""The built-in trainer's config groups and presets: a package only so that the wheel carries them (installed as pipeline.conf, see setup.py)."""
