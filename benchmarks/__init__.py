"""Benchmarks: runnable modules (`python -m benchmarks.<name>`), not tests; results go to docs/benchmarks.md."""
