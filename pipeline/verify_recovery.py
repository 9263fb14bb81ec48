"""`python -m pipeline.verify_recovery [overrides]`: see steadfast.verify_recovery."""

from steadfast.verify_recovery import main

if __name__ == "__main__":
    raise SystemExit(main())
