"""Answer-quality benchmarks: does memory make the served model answer well? locomo_qa.py asks
LoCoMo's questions through a running service in memory modes kv / prompt / none and scores the
answers with LoCoMo's own rules (locomo_scoring.py); quality_h200.py runs it over all eight
conversations on one H200 with the real SmolLM2 weights; reconcile_decisions.py records what the
served model decides when it reconciles a new fact with the memory's closest ones. Run
`.venv/bin/python -m bench.quality.locomo_qa --url http://localhost:8000 ...` against `make
serve`, `.venv/bin/python -m bench.quality.reconcile_decisions` in-process, and
bench.quality.quality_h200 as docs/quality.md describes; results go to
bench/results/locomo_qa.json and bench/results/reconcile_cpu.json.
"""
