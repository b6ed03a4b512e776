#!/usr/bin/env bash
# What message loss costs a federation of real processes: runs the same
# local federation (deploy/local_federation.sh: one `fedmesh aggregator`
# and N `fedmesh node` processes on loopback, mlp on Dirichlet(0.5) shards
# of Fashion-MNIST, synchronous rounds) twice, clean and with
# `transport.faults = "drop=P"` on every site (each site its own fault
# seed), and prints each run's wall time to the aggregator's `finished`
# event and the ratio lossy / clean.
#
# It also prints, per run, the rounds closed by their deadline (a round
# that waited for an update lost for good) and the site updates the
# aggregator applied, so a fast lossy run that lost updates shows as such.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: bench/lossy_federation.sh [options]

Options:
  --fedmesh PATH         fedmesh binary (default: $FEDMESH_BUILD_DIR/cli/fedmesh,
                         FEDMESH_BUILD_DIR defaulting to build)
  --sites N              sites (default: 4)
  --rounds R             rounds (default: 40)
  --local-steps H        local steps per round (default: 10)
  --train-limit N        training images shared by the sites (default: 2000)
  --validation-limit N   test images the aggregator evaluates (default: 500)
  --drop P               loss on every site's outgoing messages (default: 0.3)
  --faults SPEC          the lossy run's transport.faults instead of drop=P
                         (a per-site seed is added), e.g. "drop=0.3,delay=5ms"
  --deadline S           round deadline in seconds (default: 60)
  --timeout S            give up on a run after S seconds (default: 1800)
  --only clean|lossy     run just one of the two
  --port P               the aggregator's port (default: random in 20000-39999;
                         metrics ports follow at P+1000..)
  --out DIR              keep every process's JSON lines here (default: a temp
                         dir, removed)
  -h, --help             show this help

Prints one line per run (label, wall seconds, rounds, rounds closed by
deadline, updates applied, upload attempts) and then
"ratio lossy/clean: X".
EOF
}

die() { echo "lossy_federation.sh: $*" >&2; exit 2; }

ROOT=$(cd "$(dirname "$0")/.." && pwd -P)
FEDMESH="${FEDMESH_BUILD_DIR:-$ROOT/build}/cli/fedmesh"
SITES=4 ROUNDS=40 LOCAL_STEPS=10 TRAIN_LIMIT=2000 VALIDATION_LIMIT=500 DROP=0.3 FAULTS="" DEADLINE=60
TIMEOUT=1800 ONLY="" PORT=$((20000 + RANDOM % 20000)) OUT=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --fedmesh) FEDMESH=$2; shift 2 ;;
    --sites) SITES=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --local-steps) LOCAL_STEPS=$2; shift 2 ;;
    --train-limit) TRAIN_LIMIT=$2; shift 2 ;;
    --validation-limit) VALIDATION_LIMIT=$2; shift 2 ;;
    --drop) DROP=$2; shift 2 ;;
    --faults) FAULTS=$2; shift 2 ;;
    --deadline) DEADLINE=$2; shift 2 ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    --only) ONLY=$2; shift 2 ;;
    --port) PORT=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument $1" ;;
  esac
done
[[ -x $FEDMESH ]] || die "no fedmesh binary at $FEDMESH (build it, or give --fedmesh)"
[[ -z $ONLY || $ONLY == clean || $ONLY == lossy ]] || die "--only takes clean or lossy"
[[ -n $FAULTS ]] || FAULTS="drop=$DROP"
FEDMESH=$(cd "$(dirname "$FEDMESH")" && pwd -P)/$(basename "$FEDMESH")

if [[ -n $OUT ]]; then
  mkdir -p "$OUT"
  WORK=$(cd "$OUT" && pwd -P)
else
  WORK=$(mktemp -d)
fi
PIDS=()
cleanup() {
  local pid
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  [[ -n $OUT ]] || rm -rf "$WORK"
}
trap cleanup EXIT

now() { date +%s.%N; }

# run LABEL FAULTS PORT: sets RESULT to "LABEL SECONDS ROUNDS DEADLINE_CLOSED APPLIED ATTEMPTS"
run() {
  local label=$1 faults=$2 port=$3 dir="$WORK/$1" k
  "$ROOT/deploy/local_federation.sh" --fedmesh "$FEDMESH" --dir "$dir" --sites "$SITES" --port "$port" \
    --metrics-port $((port + 1000)) --rounds "$ROUNDS" --local-steps "$LOCAL_STEPS" --deadline "$DEADLINE" \
    --model mlp --agg "validation_limit = $VALIDATION_LIMIT" --agg 'linger_seconds = 2' \
    --site "data.train_limit = $TRAIN_LIMIT" --site 'give_up_seconds = 30' >/dev/null
  if [[ -n $faults ]]; then
    for ((k = 0; k < SITES; k++)); do
      printf 'transport.faults = "%s,seed=%d"\n' "$faults" $((k + 1)) >> "$dir/site-$k.toml"
    done
  fi
  PIDS=()
  local start
  start=$(now)
  "$FEDMESH" aggregator --config "$dir/agg.toml" --json > "$dir/aggregator.jsonl" 2> "$dir/aggregator.err" &
  PIDS+=($!)
  for ((k = 0; k < SITES; k++)); do
    "$FEDMESH" node --config "$dir/site-$k.toml" --json > "$dir/site-$k.jsonl" 2> "$dir/site-$k.err" &
    PIDS+=($!)
  done
  local finished=""
  while [[ -z $finished ]]; do
    if grep -q '"event":"finished"' "$dir/aggregator.jsonl" 2>/dev/null; then
      finished=$(now)
    elif ! kill -0 "${PIDS[0]}" 2>/dev/null; then
      die "$label: the aggregator exited before finishing (see $dir/aggregator.err; keep it with --out)"
    elif (($(awk -v a="$(now)" -v b="$start" 'BEGIN { print (a - b > '"$TIMEOUT"') }'))); then
      die "$label: not finished after $TIMEOUT s"
    else
      sleep 0.1
    fi
  done
  # A site that missed the end (its polls lost while the aggregator lingered)
  # gives up on its own (give_up_seconds); stop what is left after that.
  local pid deadline
  deadline=$(($(date +%s) + 40))
  for pid in "${PIDS[@]}"; do
    while kill -0 "$pid" 2>/dev/null && (($(date +%s) < deadline)); do sleep 0.2; done
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  PIDS=()
  local rounds deadline_closed applied attempts
  rounds=$(grep -c '"event":"round"' "$dir/aggregator.jsonl" || true)
  deadline_closed=$(grep '"event":"round"' "$dir/aggregator.jsonl" | grep -c '"closed_by_deadline":true' || true)
  applied=$(grep '"event":"round"' "$dir/aggregator.jsonl" | sed -n 's/.*"updates":\([0-9]*\).*/\1/p' |
    awk '{ s += $1 } END { print s + 0 }')
  attempts=$(cat "$dir"/site-*.jsonl | grep '"event":"update"' | sed -n 's/.*"attempts":\([0-9]*\).*/\1/p' |
    awk '{ s += $1 } END { print s + 0 }')
  RESULT=$(printf '%s %.1f %s %s %s %s' "$label" "$(awk -v a="$finished" -v b="$start" 'BEGIN { print a - b }')" \
    "$rounds" "$deadline_closed" "$applied" "$attempts")
}

echo "# $SITES sites, $ROUNDS rounds, $LOCAL_STEPS local steps, mlp, $TRAIN_LIMIT images; lossy: $FAULTS on every site"
printf '%-6s %8s %7s %16s %8s %9s\n' run seconds rounds closed_by_deadline applied attempts
clean_s="" lossy_s=""
if [[ $ONLY != lossy ]]; then
  run clean "" "$PORT"
  read -r label clean_s r d a t <<< "$RESULT"
  printf '%-6s %8s %7s %16s %8s %9s\n' "$label" "$clean_s" "$r" "$d" "$a" "$t"
fi
if [[ $ONLY != clean ]]; then
  run lossy "$FAULTS" $((PORT + 50))
  read -r label lossy_s r d a t <<< "$RESULT"
  printf '%-6s %8s %7s %16s %8s %9s\n' "$label" "$lossy_s" "$r" "$d" "$a" "$t"
fi
if [[ -n $clean_s && -n $lossy_s ]]; then
  awk -v l="$lossy_s" -v c="$clean_s" 'BEGIN { printf "ratio lossy/clean: %.2f\n", l / c }'
fi
