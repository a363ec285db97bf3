#!/usr/bin/env bash
# Issue 39's ingress variants side by side on one card, in one visit: the service started afresh
# under each variant in turn (config.gpu.yaml; a variant is environment only), each measured by
# bench.serve.serve_http (TTFT one at a time at k = 50 with the engine's own TTFT from the replica's
# stages, Serve's floor, Locust at 100 closed-loop users on the 400 varied questions, the replica's
# stages). Meant to run in the background on the GPU machine (an idle machine is released after
# 30 s, so the calls that follow only wait and copy): each variant writes
# <out>/<variant>/serve_<card>.json after every part, and nvidia-smi's per-process memory every
# second to <out>/<variant>/gpu_apps.csv through its start. <out>/progress says where it is.
#
#   bash bench/serve/ingress_variants.sh OUT [--cpu] [variant ...]
#
# Variants: shipped (config.gpu.yaml as it is: routing direct, each LLM replica its own ingress),
# direct (the same named explicitly), router (the ChatAPI router, 4 ingress replicas), router_tput /
# direct_tput (with RAY_SERVE_THROUGHPUT_OPTIMIZED=1), router8 (the router with 8 ingress replicas). --cpu: config.yaml here, with
# the measures cut to a dry run's size. Back here, `python -m bench.serve.ingress_variants OUT`
# merges them into one table. PYTHON names the interpreter (default python3, as on the GPU machine).
set -uo pipefail
out=${1:?usage: ingress_variants.sh OUT [--cpu] [variant ...]}; shift
cpu=""; variants=()
for arg in "$@"; do if [[ $arg == --cpu ]]; then cpu="--cpu"; else variants+=("$arg"); fi; done
(( ${#variants[@]} )) || variants=(shipped router router_tput direct_tput router8)
mkdir -p "$out"
if [[ -n $cpu ]]; then
  # seeding Locust's 40 x 55 facts takes ~13 min on 2 cores: the budget lets Locust itself run
  sizes=(--ttft-ks 50 --rounds 3 --locust-users 2 --locust-seconds 5 --budget-s 1500)
else
  sizes=(--ttft-ks 50 --rounds 20 --locust-users 100 --locust-seconds 20 --budget-s 480)
fi
for variant in "${variants[@]}"; do
  case $variant in
    shipped) env=() ;;
    router) env=(KVMEM_ROUTING=router) ;;
    direct) env=(KVMEM_ROUTING=direct) ;;
    router_tput) env=(KVMEM_ROUTING=router RAY_SERVE_THROUGHPUT_OPTIMIZED=1) ;;
    direct_tput) env=(KVMEM_ROUTING=direct RAY_SERVE_THROUGHPUT_OPTIMIZED=1) ;;
    router8) env=(KVMEM_ROUTING=router KVMEM_INGRESS_REPLICAS=8) ;;
    *) echo "unknown variant $variant" >&2; exit 2 ;;
  esac
  dir=$out/$variant; mkdir -p "$dir"
  echo "$(date -u +%T) $variant started: ${env[*]:-as shipped}" >> "$out/progress"
  printf '%s\n' "${env[@]:-}" > "$dir/environment"
  smi=""
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-compute-apps=timestamp,pid,process_name,used_memory --format=csv -l 1 > "$dir/gpu_apps.csv" 2>&1 &
    smi=$!
  fi
  env "${env[@]}" "${PYTHON:-python3}" -m bench.serve.serve_http $cpu --out "$dir" --parts ttft,floor,locust,diagnose \
    --locust-questions varied "${sizes[@]}" > "$dir/serve_http.log" 2>&1
  rc=$?
  [[ -n $smi ]] && kill "$smi" 2>/dev/null
  echo "$(date -u +%T) $variant done rc=$rc" >> "$out/progress"
done
echo "$(date -u +%T) all done" >> "$out/progress"
