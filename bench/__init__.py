"""Benchmark harness (python -m bench.run)."""
