"""Answer-quality benchmarks: does memory make the served model answer well? LoCoMo QA through the
service (locomo_qa.py, locomo_scoring.py) and extraction (extraction_locomo.py). docs/bench.md."""
