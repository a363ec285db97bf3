"""Ingest benchmarks: how fast memory goes in. ingest_locomo.py adds one LoCoMo conversation's
observation facts to a memory shard in this process (Redis, index, and the facts' KV captured
through an offline engine) and reports facts/s; its LoCoMo parsing is also what
quality/locomo_qa.py and the tests use. ingest_turns.py adds a conversation turn by turn through a
running service's HTTP API, as a chat app does, durable adds against adds that wait for their KV.
Run `.venv/bin/python -m bench.ingest.ingest_locomo --conversation 0 --window 5`, or against `make
serve` `.venv/bin/python -m bench.ingest.ingest_turns --url http://localhost:8000 --conversation
0`; results go to bench/results/locomo_ingest_cpu.json and bench/results/ingest_cpu.json.
"""
