#!/usr/bin/env bash
# Which compression gossip replicas default to, by the local optimizer
# (issue 28's text measurement; docs/gossip.md, "Which compression"):
# the aggregator path against replicas with top-k 1.5 % + int8 and with dense
# int4, for SGD and AdamW, on text (gpt-nano, 4 peers split by book, 20
# rounds of 20 steps, seed 3) and on images (the mlp, 8 peers, Dirichlet 0.5,
# 40 rounds of 20 steps, seed 9, gossip with 20 % loss). Prints a markdown
# table (bits per byte for text, mean accuracy for images, and bytes sent)
# and writes OUT/<row>.jsonl. About 8 minutes on 2 cores.
#
#   bench/gossip_by_optimizer.sh [--fedmesh build/cli/fedmesh] [--out /tmp/gossip-by-optimizer]
set -euo pipefail
FEDMESH=build/cli/fedmesh
OUT=/tmp/gossip-by-optimizer
while [[ $# -gt 0 ]]; do
  case "$1" in
    --fedmesh) FEDMESH=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    -h|--help) sed -n 2,11p "$0"; exit 0 ;;
    *) echo "gossip_by_optimizer.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ -x "$FEDMESH" ]] || { echo "gossip_by_optimizer.sh: no fedmesh binary at $FEDMESH (build first, or --fedmesh)" >&2; exit 2; }
mkdir -p "$OUT"
TEXT=(--model gpt-nano --sites 4 --partition books --rounds 20 --local-steps 20 --batch-size 16 --test-limit 200 --seed 3 --json)
IMAGES=(--sites 8 --partition dirichlet:0.5 --rounds 40 --seed 9 --json)
declare -A OPT=([sgd]="--optimizer sgd" [adamw-text]="--optimizer adamw --lr 0.003" [adamw-images]="--optimizer adamw --lr 0.001")
rows=()
run() {
  local name=$1; shift
  echo "== $name: fedmesh sim $*" >&2
  "$FEDMESH" sim "$@" > "$OUT/$name.jsonl"
  rows+=("$name")
}
for data in text images; do
  for opt in sgd adamw; do
    key=$opt; [[ $opt == adamw ]] && key=adamw-$data
    if [[ $data == text ]]; then common=("${TEXT[@]}"); gossip=(--mode gossip); else common=("${IMAGES[@]}"); gossip=(--mode gossip --loss 0.2); fi
    # shellcheck disable=SC2206
    o=(${OPT[$key]})
    run "$data-$opt-aggregator" "${common[@]}" "${o[@]}"
    run "$data-$opt-replicas-default" "${common[@]}" "${o[@]}" "${gossip[@]}"
    run "$data-$opt-replicas-topk" "${common[@]}" "${o[@]}" "${gossip[@]}" --compress topk:0.015+int8
    run "$data-$opt-replicas-int4" "${common[@]}" "${o[@]}" "${gossip[@]}" --compress int4
  done
done
run text-adamw-replicas-identity "${TEXT[@]}" ${OPT[adamw-text]} --mode gossip --compress identity
run text-adamw-replicas-default-loss0.2 "${TEXT[@]}" ${OPT[adamw-text]} --mode gossip --loss 0.2
run text-sgd-replicas-default-loss0.2 "${TEXT[@]}" ${OPT[sgd]} --mode gossip --loss 0.2
"${PYTHON:-python3}" - "$OUT" "${rows[@]}" <<'PY'
import json, sys
out, rows = sys.argv[1], sys.argv[2:]
print("| run | compression | bits per byte / mean accuracy | bytes sent |")
print("| --- | --- | --- | --- |")
for row in rows:
    lines = [json.loads(l) for l in open(f"{out}/{row}.jsonl") if l.strip()]
    start, summary = lines[0], lines[-1]
    if "bits_per_byte" in summary:
        quality = f"{summary['bits_per_byte']:.3f} bpb"
    else:
        quality = f"{100 * summary.get('mean_test_accuracy', summary.get('test_accuracy', 0)):.2f} %"
    print(f"| {row} | {start.get('compression')} | {quality} | {summary['bytes_sent'] / 1e6:.1f} MB |")
PY
