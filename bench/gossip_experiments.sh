#!/usr/bin/env bash
# Gossip against the aggregator path for 32 simulated peers.
#
# Runs `fedmesh sim --mode gossip --json` for every topology x compression
# below and `fedmesh sim --json` (the aggregator path, FedAvg) on the same
# federation in the same run (32 peers/sites, Dirichlet 0.5 shards of
# Fashion-MNIST, mlp, same local steps, lr, batch size and seed), and prints
# for each: the rounds, virtual time (local-step units), wall time and bytes
# on the wire until the mean test accuracy first reaches the target (80%),
# or 'not reached' with the best it got, and the ratio of bytes and of
# virtual time against the aggregator path.
#
# Bytes: gossip counts every message sent (framed as on the wire, lost ones
# included); the aggregator path counts the sites' uplink updates (framed)
# plus the global model it sends each sampled site (dense fp32). Accuracy:
# gossip's is the mean over the peers' own models, evaluated every
# --eval-every rounds; the aggregator's is the global model's, every round.
# Wall time is the simulation's, evaluation included (gossip evaluates all 32
# peers, the aggregator path one model): compare virtual time across paths.
# Missing the target is reported, never an error.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: bench/gossip_experiments.sh [options]

Options:
  --fedmesh PATH     fedmesh binary (default: $FEDMESH_BUILD_DIR/cli/fedmesh,
                     FEDMESH_BUILD_DIR defaulting to build)
  --out DIR          keep every run's JSON lines here (default: a temp dir,
                     removed)
  --rounds N         rounds per run (default: 60; --quick: 20)
  --local-steps H    local steps per round (default: 20; --quick: 10)
  --train-limit N    training images (default: 0 = all 60000; --quick: 12000)
  --test-limit N     test images evaluated (default: 2000; --quick: 500)
  --eval-every K     gossip: evaluate the peers every K rounds (default: 2)
  --target A         test accuracy to reach (default: 0.80; --quick: 0.70)
  --seed S           seed for every run (default: 1)
  --threads T        fedmesh compute threads (default: 0 = all cores)
  --topologies LIST  space-separated (default: "random ring exponential
                     one-peer-exponential")
  --compressions L   space-separated (default: "identity fp16 int8")
  --full-runs        run every round even after the target is reached
                     (default: stop a run once it reaches the target)
  --quick            a smoke run of the same table: 12000 images, 10 local
                     steps, 20 rounds, 500 test images, target 70% (a few
                     minutes on 2 cores; 80% takes gossip longer than that)
  -h, --help         show this help

Fixed for every run: --sites 32 --partition dirichlet:0.5 --model mlp
--batch-size 32 --lr 0.05 --optimizer sgd (momentum 0.9); gossip runs use
--merge push-sum and --fanout 2 (random, ring; the exponential topologies
choose their own peers); the aggregator run uses --strategy fedavg with
every site in every round.
EOF
}

die() { echo "gossip_experiments.sh: $*" >&2; exit 2; }
log() { echo "[gossip] $*" >&2; }

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/.." && pwd)"

FEDMESH=""
OUT=""
ROUNDS=""
LOCAL_STEPS=""
TRAIN_LIMIT=""
TEST_LIMIT=""
EVAL_EVERY=2
TARGET=""
SEED=1
THREADS=0
TOPOLOGIES="random ring exponential one-peer-exponential"
COMPRESSIONS="identity fp16 int8"
FULL_RUNS=0
QUICK=0

while [[ $# -gt 0 ]]; do
  case "$1" in
    --fedmesh) FEDMESH="${2:?--fedmesh needs a path}"; shift 2 ;;
    --out) OUT="${2:?--out needs a directory}"; shift 2 ;;
    --rounds) ROUNDS="${2:?--rounds needs N}"; shift 2 ;;
    --local-steps) LOCAL_STEPS="${2:?--local-steps needs H}"; shift 2 ;;
    --train-limit) TRAIN_LIMIT="${2:?--train-limit needs N}"; shift 2 ;;
    --test-limit) TEST_LIMIT="${2:?--test-limit needs N}"; shift 2 ;;
    --eval-every) EVAL_EVERY="${2:?--eval-every needs K}"; shift 2 ;;
    --target) TARGET="${2:?--target needs an accuracy}"; shift 2 ;;
    --seed) SEED="${2:?--seed needs S}"; shift 2 ;;
    --threads) THREADS="${2:?--threads needs T}"; shift 2 ;;
    --topologies) TOPOLOGIES="${2:?--topologies needs a list}"; shift 2 ;;
    --compressions) COMPRESSIONS="${2:?--compressions needs a list}"; shift 2 ;;
    --full-runs) FULL_RUNS=1; shift ;;
    --quick) QUICK=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done

if [[ $QUICK == 1 ]]; then
  : "${ROUNDS:=20}" "${LOCAL_STEPS:=10}" "${TRAIN_LIMIT:=12000}" "${TEST_LIMIT:=500}" "${TARGET:=0.70}"
else
  : "${ROUNDS:=60}" "${LOCAL_STEPS:=20}" "${TRAIN_LIMIT:=0}" "${TEST_LIMIT:=2000}" "${TARGET:=0.80}"
fi
for value in "$ROUNDS" "$LOCAL_STEPS" "$TRAIN_LIMIT" "$TEST_LIMIT" "$EVAL_EVERY" "$SEED" "$THREADS"; do
  [[ $value =~ ^[0-9]+$ ]] || die "'$value' is not a whole number"
done
[[ $TARGET =~ ^0?\.[0-9]+$ ]] || die "--target '$TARGET' is not an accuracy in (0, 1)"

if [[ -z $FEDMESH ]]; then
  build_dir=${FEDMESH_BUILD_DIR:-build}
  [[ $build_dir == /* ]] || build_dir="$REPO_ROOT/$build_dir"
  FEDMESH="$build_dir/cli/fedmesh"
fi
[[ -x $FEDMESH ]] || die "no fedmesh binary at $FEDMESH (build it: deploy/setup.sh, or give --fedmesh)"
command -v python3 >/dev/null || die "python3 is needed to read the JSON lines"

if [[ -z $OUT ]]; then
  OUT=$(mktemp -d)
  trap 'rm -rf "$OUT"' EXIT
fi
mkdir -p "$OUT"

COMMON=(--sites 32 --partition dirichlet:0.5 --model mlp --rounds "$ROUNDS" --local-steps "$LOCAL_STEPS"
        --batch-size 32 --lr 0.05 --optimizer sgd --train-limit "$TRAIN_LIMIT" --test-limit "$TEST_LIMIT"
        --seed "$SEED" --threads "$THREADS" --json)

# One run, streamed: stops it once it reaches the target (unless FULL is 1)
# and writes its JSON lines to OUT/LABEL.jsonl.
run() {
  local label=$1 full=$2; shift 2
  log "$label: fedmesh sim $*"
  python3 - "$OUT/$label.jsonl" "$TARGET" "$full" "$FEDMESH" sim "$@" <<'PY'
import json, subprocess, sys
out_path, target, full_runs, command = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "1", sys.argv[4:]
with open(out_path, "w") as out, subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as process:
    for line in process.stdout:
        out.write(line)
        out.flush()
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "round" and event.get("test_accuracy", 0.0) >= target and not full_runs:
            process.terminate()
            break
    process.wait()
    if process.returncode not in (0, -15):
        sys.exit(f"fedmesh exited with status {process.returncode}")
PY
}

START=$(date +%s)
# The baseline runs every round: its summary gives the downlink per round.
run aggregator 1 "${COMMON[@]}" --strategy fedavg
for topology in $TOPOLOGIES; do
  fanout=()
  [[ $topology == random || $topology == ring ]] && fanout=(--fanout 2)
  for compression in $COMPRESSIONS; do
    run "gossip-$topology-$compression" "$FULL_RUNS" "${COMMON[@]}" --mode gossip --topology "$topology" "${fanout[@]}" \
      --merge push-sum --compress "$compression" --eval-every "$EVAL_EVERY"
  done
done
log "all runs: $(( $(date +%s) - START ))s"

python3 - "$OUT" "$TARGET" "$TOPOLOGIES" "$COMPRESSIONS" <<'PY'
import json, sys
out, target = sys.argv[1], float(sys.argv[2])
topologies, compressions = sys.argv[3].split(), sys.argv[4].split()

def events(label):
    with open(f"{out}/{label}.jsonl") as f:
        return [json.loads(line) for line in f if line.startswith("{")]

def reach(label, aggregator):
    """(rounds, virtual time, wall seconds, bytes) at the first round at or past the target, or None; best accuracy."""
    lines = events(label)
    rounds = [e for e in lines if e["event"] == "round"]
    # The aggregator path's downlink, the global model to every site (dense
    # fp32), is the same every round: its total over the rounds it ran.
    downlink = 0
    if aggregator:
        summary = next(e for e in lines if e["event"] == "summary")
        downlink = summary["bytes_received"] // max(1, summary["rounds"])
    total, best = 0, 0.0
    for e in rounds:
        total = total + e["bytes"] + downlink if aggregator else e["bytes_sent"]
        if "test_accuracy" not in e:
            continue
        best = max(best, e["test_accuracy"])
        if e["test_accuracy"] >= target:
            return (e["round"], e["virtual_time"], e["wall_seconds"], total), best
    return None, best

base, base_best = reach("aggregator", True)
rows = [("aggregator (fedavg)", "dense fp32", base, base_best)]
for topology in topologies:
    for compression in compressions:
        hit, best = reach(f"gossip-{topology}-{compression}", False)
        rows.append((f"gossip {topology}", compression, hit, best))

print(f"| path | compression | rounds to {target:.0%} | virtual time | wall time | bytes on the wire | bytes vs aggregator | virtual time vs aggregator |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
for path, compression, hit, best in rows:
    if hit is None:
        print(f"| {path} | {compression} | not reached (best {best:.1%}) | | | | | |")
        continue
    r, vt, wall, total = hit
    if base is None:
        ratios = "| n/a | n/a"
    else:
        ratios = f"| {total / base[3]:.2f}x | {vt / base[1]:.2f}x"
    print(f"| {path} | {compression} | {r} | {vt:.0f} | {wall:.0f} s | {total / 1e6:.1f} MB {ratios} |")
PY
