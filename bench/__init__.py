"""Benchmarks, grouped by what they measure: engine/ (the engine and connector alone), serve/ (the
whole service through HTTP), quality/ (answers), retrieval/ (the fact search), ingest/ (adding
memory) and api/ (the HTTP API fuzzed from its schema), all on one small kit (kit/: the card,
percentiles, result files and tables, the service started as the tests and the GPU runs start it,
staging). Each script is a module run from the repository root, `python -m bench.<group>.<name>`,
named for what it measures; all write under bench/results/, each result naming the card it ran on
inside ("card"). Nothing here imports tests/ (the tests import the kit's service start).
"""
