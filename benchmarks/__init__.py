"""Benchmarks, run from the repository's root as modules: ``python -m benchmarks.scale``."""
