"""API robustness: fuzz_api.py fuzzes the live HTTP API from its own OpenAPI schema with
Schemathesis (valid and invalid requests for every operation; no status >= 500, every status, body
and content type as documented, invalid input refused, no hang), with the deep and wide bodies of
fuzz_shapes.py; logprobs_cold_start.py times the first chat with logprobs after a start. Run
`.venv/bin/python -m bench.api.fuzz_api [--examples 520] [--url http://127.0.0.1:8000]`; without
--url it starts the service itself on the CPU (bench/kit/service.py) and writes
bench/results/fuzz_cpu.json. tests/test_fuzz_api.py runs the same driver with a few examples per
operation in CI.
"""
