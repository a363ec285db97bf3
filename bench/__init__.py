"""Benchmarks grouped by what they measure (engine, serve, quality, retrieval, ingest, api) on one
kit (kit/); each is run as `python -m bench.<group>.<name>` and writes under bench/results/.
What each measures and how to run it: docs/bench.md. Nothing here imports tests/."""
