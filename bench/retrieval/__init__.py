"""Retrieval benchmarks: the fact search by itself, no LLM. locomo_recall.py measures the evidence
recall@k of LoCoMo's questions over each conversation's observation facts with the service's
embedder and an exact index, and the exact search latency on the CPU; cagra_h200.py (helpers in
cagra_h200_data.py) measures the CAGRA (cuVS) index on one GPU: build, recall@k against exact
search, latency, extend and delete. They live apart from quality/ because they measure what the
index returns, not what the model answers (docs/retrieval.md reports both; docs/quality.md only
cites the recall figures). Run `.venv/bin/python -m bench.retrieval.locomo_recall` (writes
bench/results/locomo_recall.json) and, on the GPU machine, `python3 -m bench.retrieval.cagra_h200
--out $OUT/cagra_h200.json` (docs/retrieval.md).
"""
