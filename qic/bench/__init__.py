"""Benchmarks: runnable modules (`python -m qic.bench.<name>`), not tests; results go to docs/benchmarks.md."""
