#!/usr/bin/env bash
# Gossip against the aggregator on Fashion-MNIST (issue 28's measurement):
# 8 or 32 sites, Dirichlet(0.5) shards, 40 rounds of 20 local steps, seed 9;
# gossip runs with 20 % of every message lost. Writes OUT/<setting>.jsonl
# (the JSON lines of `fedmesh sim --json`), then the table and the
# bytes-to-accuracy plot (bench/plot_gossip.py).
#
#   bench/gossip_replicas.sh [--fedmesh build/cli/fedmesh] [--out /tmp/gossip-replicas] [--sites 8]
#                            [--copy-png docs/gossip_accuracy_vs_bytes.png]
#
# Settings: aggregator (identity, the default), gossip replicas with its
# defaults (top-k 1.5 % + int8), the same with dense fp32 updates (the "dense
# fp32 gossip of the same run" the byte ratio is against), replicas with
# top-k 1 %, and push-sum with the old defaults (random topology, fanout 1,
# identity). About 2 minutes for 8 sites, 15 for 32 on 2 cores.
set -euo pipefail
FEDMESH=build/cli/fedmesh
OUT=/tmp/gossip-replicas
SITES=8
COPY_PNG=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --fedmesh) FEDMESH=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --sites) SITES=$2; shift 2 ;;
    --copy-png) COPY_PNG=$2; shift 2 ;;
    -h|--help) sed -n 2,17p "$0"; exit 0 ;;
    *) echo "gossip_replicas.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ -x "$FEDMESH" ]] || { echo "gossip_replicas.sh: no fedmesh binary at $FEDMESH (build first, or --fedmesh)" >&2; exit 2; }
mkdir -p "$OUT"
COMMON=(--sites "$SITES" --partition dirichlet:0.5 --rounds 40 --seed 9 --json)
run() {
  local name=$1; shift
  echo "== $name: fedmesh sim $*" >&2
  "$FEDMESH" sim "$@" > "$OUT/$name.jsonl"
  tail -1 "$OUT/$name.jsonl" >&2
}
run aggregator "${COMMON[@]}"
run replicas-topk1.5 "${COMMON[@]}" --mode gossip --loss 0.2 --eval-every 2
run replicas-dense "${COMMON[@]}" --mode gossip --loss 0.2 --eval-every 2 --compress identity
run replicas-topk1 "${COMMON[@]}" --mode gossip --loss 0.2 --eval-every 2 --compress topk:0.01+int8
run push-sum-old-defaults "${COMMON[@]}" --mode gossip --loss 0.2 --eval-every 2 --merge push-sum --topology random --compress identity
args=("$OUT")
[[ -n "$COPY_PNG" ]] && args+=(--copy-png "$COPY_PNG")
"${PYTHON:-python3}" "$(dirname "$0")/plot_gossip.py" "${args[@]}"
