#!/usr/bin/env bash
# Bytes-to-accuracy experiments for update compression.
#
# Runs `fedmesh sim` with the same federation for every compression setting
# (8 sites, Dirichlet 0.5 shards, mlp, same local steps / lr / rounds, fixed
# seeds), keeps each run's JSON lines, then calls bench/plot_compression.py
# for the table (OUT/table.md) and the plot (OUT/accuracy_vs_bytes.png).
#
# Resumable: a run whose OUT/<setting>__seed<S>.jsonl already holds a summary
# line is skipped, so an interrupted script picks up where it stopped.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: bench/compression_experiments.sh [options]

Runs the dense fp32 baseline and every compression setting below with
`fedmesh sim --json` for each seed, saves OUT/<setting>__seed<S>.jsonl, skips
runs already saved, then writes OUT/table.md and OUT/accuracy_vs_bytes.png
(bench/plot_compression.py). Progress goes to stderr; the table to stdout.

Fixed for every run: --sites 8 --partition dirichlet:0.5 --model mlp
--strategy fedavg --local-steps 20 --batch-size 32 --lr 0.05 (local SGD,
momentum 0.9), the same --rounds, --seed S.

Options:
  --fedmesh PATH   fedmesh binary (default: build/cli/fedmesh)
  --out DIR        results directory (default: bench/results/compression;
                   with --quick: bench/results/compression-quick)
  --rounds N       federated rounds per run (default: 60; --quick: 3)
  --seeds "S..."   seeds, space-separated (default: "1 2 3"; --quick: "1")
  --threads T      fedmesh compute threads (default: 0 = all cores)
  --only LIST      run only these settings (space-separated labels, see below)
  --python PATH    python3 with matplotlib for the plot (default: python3,
                   then /usr/bin/python3)
  --no-plot        only run the simulations
  --quick          smoke run: 3 rounds, seed 1, five settings
  -h, --help       show this help

The default run (60 rounds, seeds 1 2 3, every setting, into
bench/results/compression) also copies the plot to
bench/compression_accuracy_vs_bytes.png, the copy bench/RESULTS.md shows.

Settings (label: fedmesh flags); bytes are the uplink updates on the wire:
EOF
  local s
  for s in "${SETTINGS[@]}"; do printf '  %-42s %s\n' "${s%%|*}" "${s#*|}"; done
  cat <<'EOF'

Results in OUT are only comparable with each other: OUT/config.txt records
the fixed settings, and the script refuses to add runs with other settings.
EOF
}

die() { echo "compression_experiments.sh: $*" >&2; exit 2; }
log() { echo "[compression] $*" >&2; }

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/.." && pwd)"

# label|fedmesh flags (the label names the files: OUT/<label>__seed<S>.jsonl).
SETTINGS=(
  "dense|--compress identity"
  "fp16|--compress fp16"
  "bf16|--compress bf16"
  "int8|--compress int8"
  "int4|--compress int4"
  "int4:stochastic|--compress int4:stochastic"
  "topk:0.1+fp16|--compress topk:0.1+fp16"
  "topk:0.01+fp16|--compress topk:0.01+fp16"
  "topk:0.01+int8|--compress topk:0.01+int8"
  "topk:0.01+int8,dense-below=1024|--compress topk:0.01+int8 --dense-below 1024"
  "topk:0.003+int8|--compress topk:0.003+int8"
  "topk:0.003+int8:warmup=3|--compress topk:0.003+int8:warmup=3"
  "topk:0.003+int8:warmup=3,dense-below=1024|--compress topk:0.003+int8:warmup=3 --dense-below 1024"
  "powersgd:1|--compress powersgd:1"
  "powersgd:4|--compress powersgd:4"
  "dct-sign:32|--compress dct-sign:32"
  "dct-sign:8|--compress dct-sign:8"
  # Added after the first full run, where no setting reached 100x within 0.5 points:
  "topk:0.01+int8:warmup=3,dense-below=1024|--compress topk:0.01+int8:warmup=3 --dense-below 1024"
  "topk:0.01+int8:momentum=0.9|--compress topk:0.01+int8:momentum=0.9"
  "dct-sign:64|--compress dct-sign:64"
)
QUICK_SETTINGS="dense int8 topk:0.01+int8 powersgd:1 dct-sign:32"

FEDMESH="build/cli/fedmesh"
OUT=""
ROUNDS=""
SEEDS=""
THREADS=0
ONLY=""
PYTHON="${PYTHON:-}"
PLOT=1
QUICK=0

need_arg() { [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a value"; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --fedmesh) need_arg "$@"; FEDMESH="$2"; shift 2 ;;
    --out)     need_arg "$@"; OUT="$2"; shift 2 ;;
    --rounds)  need_arg "$@"; ROUNDS="$2"; shift 2 ;;
    --seeds)   need_arg "$@"; SEEDS="$2"; shift 2 ;;
    --threads) need_arg "$@"; THREADS="$2"; shift 2 ;;
    --only)    need_arg "$@"; ONLY="$2"; shift 2 ;;
    --python)  need_arg "$@"; PYTHON="$2"; shift 2 ;;
    --no-plot) PLOT=0; shift ;;
    --quick)   QUICK=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument: $1" ;;
  esac
done

if [[ $QUICK -eq 1 ]]; then
  : "${OUT:=bench/results/compression-quick}" "${ROUNDS:=3}" "${SEEDS:=1}" "${ONLY:=$QUICK_SETTINGS}"
else
  : "${OUT:=bench/results/compression}" "${ROUNDS:=60}" "${SEEDS:=1 2 3}"
fi
[[ "$ROUNDS" =~ ^[0-9]+$ ]] && (( 10#$ROUNDS > 0 )) || die "--rounds must be a positive integer (got '$ROUNDS')"
[[ "$THREADS" =~ ^[0-9]+$ ]] || die "--threads must be a non-negative integer (got '$THREADS')"
read -r -a SEED_LIST <<< "$SEEDS"
[[ ${#SEED_LIST[@]} -gt 0 ]] || die "--seeds is empty"
for s in "${SEED_LIST[@]}"; do [[ "$s" =~ ^[0-9]+$ ]] || die "seed '$s' is not a non-negative integer"; done

cd "$REPO_ROOT"
[[ -x "$FEDMESH" ]] || die "fedmesh binary not found or not executable: $FEDMESH (build it first: meson setup build && ninja -C build)"

# The settings to run, in table order.
RUN=()
if [[ -n "$ONLY" ]]; then
  read -r -a ONLY_LIST <<< "$ONLY"
  for want in "${ONLY_LIST[@]}"; do
    found=0
    for s in "${SETTINGS[@]}"; do [[ "${s%%|*}" == "$want" ]] && { found=1; break; }; done
    [[ $found -eq 1 ]] || die "unknown setting '$want' (see --help)"
  done
  for s in "${SETTINGS[@]}"; do
    for want in "${ONLY_LIST[@]}"; do [[ "${s%%|*}" == "$want" ]] && RUN+=("$s"); done
  done
else
  RUN=("${SETTINGS[@]}")
fi

# Flags shared by every run; OUT/config.txt pins them.
COMMON=(--sites 8 --partition dirichlet:0.5 --model mlp --strategy fedavg --local-steps 20
        --batch-size 32 --lr 0.05 --rounds "$ROUNDS")
mkdir -p "$OUT"
CONFIG="fedmesh sim ${COMMON[*]} --seed S --json"
if [[ -f "$OUT/config.txt" ]]; then
  [[ "$(cat "$OUT/config.txt")" == "$CONFIG" ]] ||
    die "$OUT holds runs made with other settings ($(cat "$OUT/config.txt")); use another --out"
else
  printf '%s\n' "$CONFIG" >"$OUT/config.txt"
fi
# label<TAB>flags for every setting known (the plot script's order and flags).
for s in "${SETTINGS[@]}"; do printf '%s\t%s\n' "${s%%|*}" "${s#*|}"; done >"$OUT/settings.tsv"

TOTAL=$(( ${#RUN[@]} * ${#SEED_LIST[@]} ))
BIN_SHA="$(sha256sum "$FEDMESH" | cut -c1-16)"
log "$TOTAL runs (${#RUN[@]} settings x ${#SEED_LIST[@]} seeds), $ROUNDS rounds each, into $OUT"
log "fedmesh: $FEDMESH (sha256 $BIN_SHA...)"

START=$SECONDS
i=0
ran=0
for s in "${RUN[@]}"; do
  label="${s%%|*}"
  read -r -a flags <<< "${s#*|}"
  for seed in "${SEED_LIST[@]}"; do
    i=$(( i + 1 ))
    file="$OUT/${label}__seed${seed}.jsonl"
    if [[ -s "$file" ]] && grep -q '"event":"summary"' "$file"; then
      log "run $i of $TOTAL: $label seed $seed: already in $file, skipped"
      continue
    fi
    t0=$SECONDS
    if "$FEDMESH" sim "${COMMON[@]}" --seed "$seed" --threads "$THREADS" "${flags[@]}" --json \
         >"$file.part" 2>"$file.err"; then
      mv "$file.part" "$file"
      rm -f "$file.err"
    else
      rc=$?
      log "run $i of $TOTAL: $label seed $seed FAILED (rc $rc); stderr tail:"
      tail -n 5 "$file.err" >&2 || true
      rm -f "$file.part"
      exit 1
    fi
    ran=$(( ran + 1 ))
    dt=$(( SECONDS - t0 ))
    printf '%s\t%s\t%s\t%s\n' "$label" "$seed" "$dt" "$BIN_SHA" >>"$OUT/runs.log"
    summary="$(grep '"event":"summary"' "$file" | tail -n 1)"
    acc="$(sed -n 's/.*"test_accuracy":\([0-9.eE+-]*\).*/\1/p' <<<"$summary")"
    bytes="$(sed -n 's/.*"bytes_sent":\([0-9]*\).*/\1/p' <<<"$summary")"
    log "run $i of $TOTAL: $label seed $seed: accuracy $acc, $bytes bytes sent, ${dt} s (elapsed $(( SECONDS - START )) s)"
  done
done
log "$ran runs made, $(( TOTAL - ran )) already there; $(( SECONDS - START )) s"

[[ $PLOT -eq 1 ]] || exit 0

has_mpl() { "$1" -c 'import matplotlib' >/dev/null 2>&1; }
PY=""
for c in ${PYTHON:+"$PYTHON"} python3 /usr/bin/python3; do
  if command -v "$c" >/dev/null 2>&1 && has_mpl "$c"; then PY="$(command -v "$c")"; break; fi
done
if [[ -z "$PY" ]]; then
  PY="${PYTHON:-python3}"
  log "no python3 here imports matplotlib; the table is still written, the plot is not"
fi
PLOT_ARGS=("$OUT")
# The committed copy comes from the default full run only (not --quick, --out
# elsewhere or other --rounds/--seeds/--only).
if [[ $QUICK -eq 0 && "$OUT" == bench/results/compression && "$ROUNDS" == 60 && "$SEEDS" == "1 2 3" && -z "$ONLY" ]]; then
  PLOT_ARGS+=(--copy-png "$SCRIPT_DIR/compression_accuracy_vs_bytes.png")
fi
"$PY" "$SCRIPT_DIR/plot_compression.py" "${PLOT_ARGS[@]}"
