"""Ingest benchmarks: how fast memory goes in, in-process (ingest_locomo.py), and a reconciled add's
latency (add_latency.py); turn by turn through HTTP: bench.serve.serve_http's `ingest`. docs/bench.md."""
