"""Retrieval benchmarks: the fact search by itself, no LLM: LoCoMo evidence recall per retriever and
CPU search latency (locomo_recall.py, locomo_retrievers.py). docs/bench.md."""
