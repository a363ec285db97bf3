"""Answer-quality benchmarks: does memory make the served model answer well? locomo_qa.py asks
LoCoMo's questions through a running service in memory modes kv / prompt / none and scores the
answers with LoCoMo's own rules (locomo_scoring.py); qa_sweep.py runs it over all eight
conversations on a GPU with the real SmolLM2 weights, one fresh service per setting;
extraction_locomo.py judges extraction against LoCoMo's annotations; reconcile_decisions.py
records what the served model decides when it reconciles a new fact with the memory's closest
ones. Run `.venv/bin/python -m bench.quality.locomo_qa --url http://localhost:8000 ...` against
`make serve`, `.venv/bin/python -m bench.quality.reconcile_decisions` in-process, and
bench.quality.qa_sweep as docs/quality.md describes.
"""
