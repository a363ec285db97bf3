#!/bin/bash
# Where a chat's time goes under load, on a service that bench.serve.serve_http left running (--keep-running):
# closed-loop Locust runs (mode none, the 400 varied questions, 10 s each) at users x max_tokens, each
# printing QPS, the client's TTFT and the replica's own stages (the SERVER rows loadtest/locustfile.py
# reads from each stream's finishing chunk; outside_replica = TTFT - replica_ttft). Then 100 users, 50
# tokens, 12 s, modes none and kv, with 4 and with 12 Locust processes: is the client the limit?
# Mode kv needs the Locust pool seeded: run it after bench.serve.serve_http's locust part, as on the H200
# (bench/results/serve_h200.json, locust_diagnosis_2026_12_03, holds its rows).
#     bash bench/serve/serve_load_diagnosis.sh        (on the GPU machine, PYTHONPATH as for bench.serve.serve_http)
set -euo pipefail
STATE=/tmp/kvmem-serve-bench.json
URL=$(python3 -c "import json; print(json.load(open('$STATE'))['url'])")
KEY=$(python3 -c "import json; print(json.load(open('$STATE'))['admin_key'])")
CSV=$(mktemp -d)
run() {  # users max_tokens mode processes seconds
  KVMEM_LOADTEST_USERS=40 KVMEM_LOADTEST_FACTS=0 KVMEM_LOADTEST_MEMORY_MODE=$3 KVMEM_LOADTEST_TOP_K=50 \
  KVMEM_LOADTEST_MAX_TOKENS=$2 KVMEM_LOADTEST_WAIT_S=0 KVMEM_LOADTEST_API_KEY=$KEY KVMEM_LOADTEST_QUESTIONS=varied \
    timeout 60 python3 -m locust -f loadtest/locustfile.py --headless -u "$1" -r "$1" -t "$5"s --host "$URL" \
    --csv "$CSV/r" --only-summary --processes "$4" > "$CSV/log" 2>&1
  python3 - "$CSV/r_stats.csv" "users $1 max_tokens $2 mode $3 processes $4" <<'PY'
import csv, sys
rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(open(sys.argv[1]))}
chat, first = rows.get(("POST", "chat"), {}), rows.get(("TTFT", "chat"), {})  # absent when no chat finished
server = {name: row["50%"] for (kind, name), row in rows.items() if kind == "SERVER"}
print(sys.argv[2], "| qps", round(float(chat.get("Requests/s", 0)), 1), "| ttft p50", first.get("50%"), "p99", first.get("99%"),
      "| server p50", server)
PY
}
for spec in "10 50" "100 1" "100 50" "50 50"; do
  set -- $spec
  run "$1" "$2" none 4 10
done
for processes in 4 12; do
  for mode in none kv; do
    run 100 50 "$mode" "$processes" 12
  done
done
