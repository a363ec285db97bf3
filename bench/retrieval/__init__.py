"""Retrieval benchmarks: the fact search by itself, no LLM: LoCoMo evidence recall per retriever and
CPU search latency (locomo_recall.py), the CAGRA index on a GPU (cagra_index.py). docs/bench.md."""
