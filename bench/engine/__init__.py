"""Engine benchmarks: the vLLM engine with the KV-memory connector, without the service around it
(TTFT on GPU and CPU, the kernels, bf16 fidelity, the connector's host time). See docs/bench.md."""
