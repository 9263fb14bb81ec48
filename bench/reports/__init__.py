"""BENCHMARKS.md, section by section: each module turns one benchmark's results into its rows of the
summary table (`rows`) and its section (`section`); bench/report.py puts them together."""
