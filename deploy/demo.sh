#!/usr/bin/env bash
# fedmesh quick start: set up and build, then run a federation on this
# machine: one aggregator and 4 sites as separate processes on loopback,
# with keys and a signed roster made on the fly, each site training on its
# own Dirichlet(0.5) shard of Fashion-MNIST.
set -euo pipefail

DEPLOY=$(cd -- "$(dirname -- "$(readlink -f -- "${BASH_SOURCE[0]}")")" && pwd -P)

usage() {
  cat <<EOF
Usage: deploy/demo.sh [--sites 4] [--rounds 15] [--local-steps 60] [--mode sync|fedbuff|fedasync]
                      [--compress SPEC] [--port 7400] [--dir DIR] [--keep]

Runs deploy/setup.sh (installs missing packages, builds; its progress goes to
stderr), then starts a local federation with deploy/local_federation.sh:

  fedmesh aggregator --config DIR/agg.toml       (tcp://127.0.0.1:PORT, metrics on PORT+2000)
  fedmesh node --config DIR/site-K.toml          (K = 0 .. SITES-1)

prints each round and the global test accuracy, and at the end where the
checkpoints are. While it runs, another terminal can watch it with
  BUILD/cli/fedmesh status --aggregator 127.0.0.1:\$((PORT + 2000))
DIR defaults to a new directory under /tmp; its logs are DIR/*.log. It is
removed at the end unless --keep or --dir is given. --compress sets how the
sites compress their updates (e.g. topk:0.01+int8; docs/compression.md).
EOF
}

SITES=4 ROUNDS=15 LOCAL_STEPS=60 MODE=sync PORT=7400 DIR="" KEEP=0 COMPRESS=identity
while [[ $# -gt 0 ]]; do
  case $1 in
    --sites) SITES=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --local-steps) LOCAL_STEPS=$2; shift 2 ;;
    --mode) MODE=$2; shift 2 ;;
    --compress) COMPRESS=$2; shift 2 ;;
    --port) PORT=$2; shift 2 ;;
    --dir) DIR=$2; KEEP=1; shift 2 ;;
    --keep) KEEP=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) printf 'fedmesh demo: unknown argument %s\n' "$1" >&2; usage >&2; exit 2 ;;
  esac
done

# Setup messages on stderr keep stdout for the federation's progress.
bash "$DEPLOY/setup.sh" >&2 || {
  printf 'fedmesh demo: error: setup failed\n' >&2
  exit 1
}
BUILD=$(bash "$DEPLOY/setup.sh" --print-build-dir)
BIN=$BUILD/cli/fedmesh
[[ -x $BIN ]] || { printf 'fedmesh demo: error: %s was not built (kernels_only build?)\n' "$BIN" >&2; exit 1; }

[[ -n $DIR ]] || DIR=$(mktemp -u /tmp/fedmesh-demo.XXXXXX)
METRICS=$((PORT + 2000))
EXTRA=(--site "compression.default = \"$COMPRESS\"")
[[ $MODE == sync ]] || EXTRA+=(--agg 'buffer_size = 3' --min-sites 1)
bash "$DEPLOY/local_federation.sh" --fedmesh "$BIN" --dir "$DIR" --sites "$SITES" --port "$PORT" \
  --metrics-port "$METRICS" --rounds "$ROUNDS" --local-steps "$LOCAL_STEPS" --mode "$MODE" "${EXTRA[@]}" >/dev/null

PIDS=()
cleanup() {
  local pid
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [[ $KEEP == 0 ]]; then rm -rf "$DIR"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

printf 'fedmesh demo: a federation of %s sites in %s (%s rounds, %s local steps each)\n' \
  "$SITES" "$DIR" "$ROUNDS" "$LOCAL_STEPS"
printf 'fedmesh demo: watch it from another terminal: %s status --aggregator 127.0.0.1:%s\n' "$BIN" "$METRICS"
printf 'fedmesh demo: or in a browser on this machine: http://127.0.0.1:%s/dashboard\n' "$METRICS"
"$BIN" aggregator --config "$DIR/agg.toml" 2>&1 | tee "$DIR/aggregator.log" &
PIDS+=($!)
for ((k = 0; k < SITES; k++)); do
  "$BIN" node --config "$DIR/site-$k.toml" >"$DIR/site-$k.log" 2>&1 &
  PIDS+=($!)
done
# The aggregator ends after its last round (and a short linger); sites stop
# when they hear that the federation finished.
status=0
wait "${PIDS[0]}" || status=$?
for pid in "${PIDS[@]:1}"; do wait "$pid" || status=$?; done
PIDS=()
if [[ $status != 0 ]]; then
  printf 'fedmesh demo: a process failed (exit %s); logs in %s\n' "$status" "$DIR" >&2
  KEEP=1
  exit 1
fi
printf 'fedmesh demo: done. Aggregator checkpoints: %s/aggregator.db (try: %s checkpoint list %s/aggregator.db)\n' \
  "$DIR" "$BIN" "$DIR"
printf 'fedmesh demo: each site checkpoints its own state in %s/site-K.db; logs in %s/*.log\n' "$DIR" "$DIR"
if [[ $KEEP == 0 ]]; then
  printf 'fedmesh demo: (%s is removed now; run with --keep to look inside)\n' "$DIR"
fi
