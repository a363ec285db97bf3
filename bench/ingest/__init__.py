"""Ingest benchmarks: how fast memory goes in, in-process (ingest_locomo.py), through HTTP turn by
turn (ingest_turns.py) and a reconciled add's latency (add_latency.py). See docs/bench.md."""
