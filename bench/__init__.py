"""Benchmarks, grouped by what they measure: engine/ (the engine and connector alone), serve/ (the
whole service through HTTP), quality/ (answers), retrieval/ (the fact search), ingest/ (adding
memory) and api/ (the HTTP API fuzzed from its schema). Each script is a module run from the
repository root, `python -m bench.<group>.<name>`; all write under bench/results/, whose file
names do not depend on the group.
"""
