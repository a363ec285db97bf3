"""Retrieval benchmarks: the fact search by itself, no LLM. locomo_recall.py measures the evidence
recall@k of LoCoMo's questions over each conversation's observation facts with the service's
embedder and an exact index, and the exact search latency on the CPU (its retrievers and
second-stage alternatives in locomo_retrievers.py and locomo_second_stage.py); cagra_index.py
(data in cagra_data.py) measures the CAGRA (cuVS) index on a GPU: build, recall@k against exact
search, latency, extend and delete. They live apart from quality/ because they measure what the
index returns, not what the model answers. Run `.venv/bin/python -m bench.retrieval.locomo_recall`
(writes bench/results/locomo_recall.json) and, on the GPU machine, `python3 -m
bench.retrieval.cagra_index --out $OUT/cagra_h200.json` (docs/retrieval.md).
"""
