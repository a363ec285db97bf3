"""API robustness: the live HTTP API fuzzed from its OpenAPI schema (fuzz_api.py) with the deep and
wide bodies the schema cannot describe (fuzz_shapes.py). docs/bench.md says how to run them."""
