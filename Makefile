# The two commands of the README. Both do the whole set-up of a fresh machine first.
.PHONY: serve serve-gpu test setup
setup:
	bash scripts/setup.sh
serve:
	bash scripts/serve.sh
test:
	bash scripts/test.sh
# The GPU quickstart (README): MODEL=<hub id or folder>, default the embedded SmolLM2.
serve-gpu:
	bash scripts/serve_gpu.sh
