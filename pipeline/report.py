"""`python -m pipeline.report RUN_FOLDER`: see steadfast.report."""

from steadfast.report import main

if __name__ == "__main__":
    raise SystemExit(main())
