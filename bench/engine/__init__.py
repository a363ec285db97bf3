"""Engine benchmarks: the vLLM engine with the KV-memory connector, without the service around it
(TTFT and QPS on a GPU, the kernel tests, the shared engine set-up). See docs/bench.md."""
