# The two commands of the README. Both do the whole set-up of a fresh machine first.
.PHONY: serve test setup
setup:
	bash scripts/setup.sh
serve:
	bash scripts/serve.sh
test:
	bash scripts/test.sh
