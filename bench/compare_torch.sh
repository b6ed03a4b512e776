#!/usr/bin/env bash
# Compare fedmesh's training throughput with PyTorch on this machine, in the
# same run: same model, batch size, optimizer (AdamW lr=1e-3 wd=1e-4), thread
# count, data (Fashion-MNIST), device (CPU by default, or one CUDA GPU) and
# precision.  Prints a table and one JSON line per model with the ratio
# fedmesh/PyTorch (samples per second); with --device cuda also the ratio to
# PyTorch with torch.compile.
#
# Missing a target is reported, never an error; the exit status is non-zero
# only when a run itself fails or the setup is broken.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: bench/compare_torch.sh [options]

Runs `fedmesh train ... --json` and bench/torch_train.py with identical
settings for each model and prints samples/s of both, the ratio
fedmesh/PyTorch, the target and both test accuracies.  With --device cuda
PyTorch runs twice, eager and with --compile (torch.compile), and the report
adds the compiled samples/s and the ratio fedmesh/torch.compile
("ratio_compile" in the JSON).

Options:
  --models LIST        comma-separated models (default: mlp,cnn)
  --batch-size B       batch size (default: 64)
  --threads T          compute threads for both frameworks (default: 2)
  --epochs E           train E epochs (default: 1)
  --steps N            train N optimizer steps instead of epochs
  --repeat R           run each framework R times, alternating which goes
                       first, and report the median samples/s (default: 1)
  --seed S             seed passed to both (default: 0)
  --device D           cpu (default) or cuda: `fedmesh train --device cuda` against
                       torch_train.py --device cuda (model, optimizer state and
                       batches on the GPU; by default PyTorch keeps the whole
                       training set on the GPU, --loader resident) and against
                       torch_train.py --device cuda --compile. Needs a python whose
                       torch has CUDA (Debian's python3-torch has not: give --python);
                       exits 2 at once when none is found
  --precision P        fp32 (default), bf16 or fp16 for both: fedmesh --precision P,
                       PyTorch autocast with fp32 master weights (+ GradScaler for
                       fp16 on cuda). Debian's torch 1.13 refuses fp16 on the CPU
  --no-compile         with --device cuda: skip the torch.compile run
  --data-dir DIR       Fashion-MNIST IDX directory (default: /usr/share/datasets/fashion-mnist);
                       when given it is also passed to fedmesh as --data DIR
  --fedmesh PATH       fedmesh binary (default: ${FEDMESH_BUILD_DIR:-build}/cli/fedmesh)
  --python PATH        python with torch+numpy (default: auto; python3, then /usr/bin/python3)
  --out-dir DIR        keep raw outputs of every run here (default: a temp dir, removed)
  --torch-tuned        run PyTorch with OMP_WAIT_POLICY=passive (a tuned baseline;
                       the default is PyTorch as a typical user runs it)
  --no-install         do not apt-get install python3-torch/python3-numpy when missing
  -h, --help           show this help

Environment:
  FEDMESH_BUILD_DIR    fedmesh build directory, relative to the repository root
                       or absolute (default: build); if
                       $FEDMESH_BUILD_DIR/cli/fedmesh is missing, deploy/setup.sh is run
  FEDMESH_EXTRA_ARGS   extra arguments appended to every `fedmesh train` call
  TORCH_EXTRA_ARGS     extra arguments appended to every torch_train.py call (eager
                       and compiled), e.g. "--omp-wait-policy passive" for a tuned
                       PyTorch baseline (Debian's torch otherwise loses up to ~2x on
                       small models to libgomp workers spinning against OpenBLAS's own
                       thread pool), "--loader dataloader" (cuda: batches from a host
                       DataLoader), "--compile-mode max-autotune", "--warmup-steps 10"

Timing: PyTorch leaves its warm-up steps out (1 on the CPU; 5 on cuda, where
torch.compile compiles inside them; compile time is reported apart), fedmesh
times all its steps.

Targets (fedmesh/PyTorch samples/s): on the CPU mlp >= 1.5, cnn >= 1.0; on
cuda mlp >= 1.0 and cnn >= 1.0 against PyTorch eager (the ratio to
torch.compile is reported, without a target).
EOF
}

die() { echo "compare_torch.sh: $*" >&2; exit 2; }
log() { echo "[compare_torch] $*" >&2; }

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/.." && pwd)"

MODELS="mlp,cnn"
BATCH=64
THREADS=2
EPOCHS=""
STEPS=""
REPEAT=1
SEED=0
DATA_DIR="/usr/share/datasets/fashion-mnist"
FEDMESH=""
PYTHON="${PYTHON:-}"
OUT_DIR=""
INSTALL=1
TORCH_TUNED=0
DATA_DIR_SET=0
DEVICE=cpu
PRECISION=fp32
COMPILE=1

need_arg() { [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a value"; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --models)     need_arg "$@"; MODELS="$2"; shift 2 ;;
    --batch-size) need_arg "$@"; BATCH="$2"; shift 2 ;;
    --threads)    need_arg "$@"; THREADS="$2"; shift 2 ;;
    --epochs)     need_arg "$@"; EPOCHS="$2"; shift 2 ;;
    --steps)      need_arg "$@"; STEPS="$2"; shift 2 ;;
    --repeat)     need_arg "$@"; REPEAT="$2"; shift 2 ;;
    --seed)       need_arg "$@"; SEED="$2"; shift 2 ;;
    --device)     need_arg "$@"; DEVICE="$2"; shift 2 ;;
    --precision)  need_arg "$@"; PRECISION="$2"; shift 2 ;;
    --no-compile) COMPILE=0; shift ;;
    --data-dir)   need_arg "$@"; DATA_DIR="$2"; DATA_DIR_SET=1; shift 2 ;;
    --fedmesh)    need_arg "$@"; FEDMESH="$2"; shift 2 ;;
    --python)     need_arg "$@"; PYTHON="$2"; shift 2 ;;
    --out-dir)    need_arg "$@"; OUT_DIR="$2"; shift 2 ;;
    --no-install) INSTALL=0; shift ;;
    --torch-tuned) TORCH_TUNED=1; shift ;;
    -h|--help)    usage; exit 0 ;;
    *) usage >&2; die "unknown argument: $1" ;;
  esac
done

is_uint() { [[ "$1" =~ ^[0-9]+$ ]] && (( 10#$1 > 0 )); }
[[ -n "$EPOCHS" && -n "$STEPS" ]] && die "--epochs and --steps are mutually exclusive"
[[ -z "$EPOCHS" && -z "$STEPS" ]] && EPOCHS=1
is_uint "$BATCH" || die "--batch-size must be a positive integer (got '$BATCH')"
is_uint "$THREADS" || die "--threads must be a positive integer (got '$THREADS')"
is_uint "$REPEAT" || die "--repeat must be a positive integer (got '$REPEAT')"
[[ -z "$EPOCHS" ]] || is_uint "$EPOCHS" || die "--epochs must be a positive integer"
[[ -z "$STEPS" ]] || { is_uint "$STEPS" && (( STEPS >= 2 )); } || die "--steps must be an integer >= 2"
[[ "$SEED" =~ ^[0-9]+$ ]] || die "--seed must be a non-negative integer"
[[ "$DEVICE" == cpu || "$DEVICE" == cuda ]] || die "--device must be cpu or cuda (got '$DEVICE')"
[[ "$PRECISION" == fp32 || "$PRECISION" == bf16 || "$PRECISION" == fp16 ]] ||
  die "--precision must be fp32, bf16 or fp16 (got '$PRECISION')"
[[ "$DEVICE" == cuda ]] || COMPILE=0   # the torch.compile run belongs to the GPU comparison
IFS=',' read -r -a MODEL_LIST <<< "$MODELS"
[[ ${#MODEL_LIST[@]} -gt 0 ]] || die "--models is empty"
for m in "${MODEL_LIST[@]}"; do
  [[ "$m" == mlp || "$m" == cnn ]] || die "unknown model '$m' (expected mlp or cnn)"
done

cd "$REPO_ROOT"

# ---------------------------------------------------------------------------
# Python with torch + numpy (Debian's python3-torch lives in /usr/bin/python3's
# dist-packages; a pyenv/venv python3 earlier on PATH will not see it).
# ---------------------------------------------------------------------------
source "$SCRIPT_DIR/torch_python.sh"

if [[ "$DEVICE" == cuda ]]; then
  # No apt-get install here: Debian's python3-torch is a CPU-only build.
  PY="$(find_cuda_python)" || die "$(cuda_python_refusal)"
elif ! PY="$(find_python)"; then
  [[ -n "$PYTHON" ]] && die "$PYTHON cannot import torch and numpy"
  [[ $INSTALL -eq 1 ]] || die "no python3 can import torch and numpy (install python3-torch python3-numpy)"
  if [[ $(id -u) -eq 0 ]]; then SUDO=()
  elif command -v sudo >/dev/null 2>&1; then SUDO=(sudo)
  else die "python3-torch/python3-numpy missing and not root (no sudo) to apt-get install them"; fi
  log "installing python3-torch python3-numpy with apt-get"
  "${SUDO[@]}" apt-get update
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3-torch python3-numpy
  PY="$(find_python)" || die "torch still not importable after apt-get install"
fi
log "python: $PY ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"

# ---------------------------------------------------------------------------
# fedmesh binary
# ---------------------------------------------------------------------------
if [[ -z "$FEDMESH" ]]; then
  FEDMESH="${FEDMESH_BUILD_DIR:-build}/cli/fedmesh"
  if [[ ! -x "$FEDMESH" ]]; then
    [[ -f deploy/setup.sh ]] || die "$FEDMESH not found and deploy/setup.sh missing"
    log "$FEDMESH not found; running deploy/setup.sh"
    bash deploy/setup.sh >&2   # keep stdout for the report
  fi
fi
[[ -x "$FEDMESH" ]] || die "fedmesh binary not found or not executable: $FEDMESH"
log "fedmesh: $FEDMESH"

# ---------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------
if [[ -n "$OUT_DIR" ]]; then
  mkdir -p "$OUT_DIR"
else
  OUT_DIR="$(mktemp -d "${TMPDIR:-/tmp}/fedmesh-vs-torch.XXXXXX")"
  trap 'rm -rf "$OUT_DIR"' EXIT
fi

if [[ -n "$STEPS" ]]; then LEN_ARGS=(--steps "$STEPS"); else LEN_ARGS=(--epochs "$EPOCHS"); fi
read -r -a FM_EXTRA <<< "${FEDMESH_EXTRA_ARGS:-}"
[[ $DATA_DIR_SET -eq 1 ]] && FM_EXTRA=(--data "$DATA_DIR" "${FM_EXTRA[@]}")
read -r -a PT_EXTRA <<< "${TORCH_EXTRA_ARGS:-}"
[[ $TORCH_TUNED -eq 1 ]] && PT_EXTRA=(--omp-wait-policy passive "${PT_EXTRA[@]}")
# --device / --precision for both sides; left out at their defaults (cpu,
# fp32) so that the CPU commands are exactly the ones of before.
DEV_ARGS=()
[[ "$DEVICE" != cpu ]] && DEV_ARGS+=(--device "$DEVICE")
[[ "$PRECISION" != fp32 ]] && DEV_ARGS+=(--precision "$PRECISION")
FRAMEWORKS=(fedmesh pytorch)
[[ $COMPILE -eq 1 ]] && FRAMEWORKS+=(pytorch-compile)

# CPUs kept busy by other processes right before a run (we are idle then):
# sampled from /proc/stat over 0.5 s.  The load average would mostly show our
# own previous run.
busy_cpus() {
  local a b
  a=$(head -n1 /proc/stat 2>/dev/null) || { echo n/a; return; }
  sleep 0.5
  b=$(head -n1 /proc/stat 2>/dev/null) || { echo n/a; return; }
  awk -v a="$a" -v b="$b" -v n="$(nproc 2>/dev/null || echo 1)" 'BEGIN {
    split(a, x); split(b, y); tot = 0
    for (i = 2; i <= 9; i++) tot += y[i] - x[i]
    idle = (y[5] - x[5]) + (y[6] - x[6])
    busy = 0
    if (tot > 0) busy = n * (1 - idle / tot)
    printf "%.2f\n", busy }'
}

run_fedmesh() {  # model rep
  local out="$OUT_DIR/fedmesh-$1-$2"
  busy_cpus >"$out.busy"
  log "fedmesh $1 run $2/$REPEAT (CPUs busy with other work just before: $(cat "$out.busy"))"
  if "$FEDMESH" train --model "$1" "${LEN_ARGS[@]}" --batch-size "$BATCH" --threads "$THREADS" \
       --seed "$SEED" --json "${DEV_ARGS[@]}" "${FM_EXTRA[@]}" >"$out.out" 2>"$out.err"; then
    echo 0 >"$out.rc"
  else
    echo $? >"$out.rc"; log "fedmesh $1 run $2 FAILED (rc $(cat "$out.rc")); stderr tail:"; tail -n 5 "$out.err" >&2 || true
  fi
}
run_torch() {  # model rep [pytorch|pytorch-compile]
  local fw="${3:-pytorch}" compile_args=()
  [[ "$fw" == pytorch-compile ]] && compile_args=(--compile)
  local out="$OUT_DIR/$fw-$1-$2"
  busy_cpus >"$out.busy"
  log "$fw $1 run $2/$REPEAT (CPUs busy with other work just before: $(cat "$out.busy"))"
  if "$PY" "$SCRIPT_DIR/torch_train.py" --model "$1" "${LEN_ARGS[@]}" --batch-size "$BATCH" \
       --threads "$THREADS" --seed "$SEED" --data-dir "$DATA_DIR" "${DEV_ARGS[@]}" "${compile_args[@]}" \
       "${PT_EXTRA[@]}" >"$out.out" 2>"$out.err"; then
    echo 0 >"$out.rc"
  else
    echo $? >"$out.rc"; log "$fw $1 run $2 FAILED (rc $(cat "$out.rc")); stderr tail:"; tail -n 5 "$out.err" >&2 || true
  fi
}
run_one() {  # framework model rep
  case "$1" in
    fedmesh) run_fedmesh "$2" "$3" ;;
    *)       run_torch "$2" "$3" "$1" ;;
  esac
}

for m in "${MODEL_LIST[@]}"; do
  for ((r = 1; r <= REPEAT; r++)); do
    # Alternate the order so slow drifts of a noisy machine hit every side.
    if (( r % 2 == 1 )); then
      for ((i = 0; i < ${#FRAMEWORKS[@]}; i++)); do run_one "${FRAMEWORKS[i]}" "$m" "$r"; done
    else
      for ((i = ${#FRAMEWORKS[@]} - 1; i >= 0; i--)); do run_one "${FRAMEWORKS[i]}" "$m" "$r"; done
    fi
  done
done

# ---------------------------------------------------------------------------
# Report (stdlib-only python: any python3 will do, prefer the torch one)
# ---------------------------------------------------------------------------
set +e
"$PY" - "$OUT_DIR" "$MODELS" "$REPEAT" "$BATCH" "$THREADS" "${EPOCHS:-}" "${STEPS:-}" "$(nproc 2>/dev/null || echo 0)" "${PT_EXTRA[*]}" \
  "$DEVICE" "$PRECISION" "$COMPILE" <<'PYEOF'
import json, os, statistics, sys

out_dir, models, repeat, batch, threads, epochs, steps, ncpu, torch_extra, device, precision, compile_run = sys.argv[1:13]
ncpu = int(ncpu)
models = models.split(",")
repeat, batch, threads = int(repeat), int(batch), int(threads)
on_cuda = device == "cuda"
compile_run = compile_run == "1"
# On the CPU: the issue-2 targets; on one GPU: at least PyTorch eager's speed.
TARGETS = {"mlp": 1.0, "cnn": 1.0} if on_cuda else {"mlp": 1.5, "cnn": 1.0}
FRAMEWORKS = ("fedmesh", "pytorch") + (("pytorch-compile",) if compile_run else ())

def json_lines(path):
    objs = []
    try:
        with open(path, errors="replace") as f:
            for line in f:
                line = line.strip()
                if not line.startswith("{"):
                    continue
                try:
                    o = json.loads(line)
                except ValueError:
                    continue
                if isinstance(o, dict):
                    objs.append(o)
    except OSError:
        pass
    return objs

def stderr_line(base):
    """The run's own error line: the first "fedmesh ..:" / "torch_...py:" line
    of its stderr, else its last non-empty line (a traceback's exception)."""
    try:
        lines = [l.strip() for l in open(base + ".err", errors="replace") if l.strip()]
    except OSError:
        return None
    for l in lines:
        if l.startswith(("fedmesh", "torch_train.py:")):
            return l
    return lines[-1] if lines else None

def load(framework, model, rep):
    base = os.path.join(out_dir, f"{framework}-{model}-{rep}")
    try:
        rc = int(open(base + ".rc").read().strip())
    except (OSError, ValueError):
        rc = None
    objs = json_lines(base + ".out")
    if framework == "fedmesh":
        cand = [o for o in objs if o.get("event") == "summary"]
    else:
        cand = [o for o in objs if o.get("framework") == "pytorch"]
    rec = cand[-1] if cand else None
    err = None
    if rc != 0:
        err = f"exit status {rc}"
        line = stderr_line(base)
        if line and on_cuda:  # (CPU reports stay as they were)
            err += f": {line}"
    elif rec is None:
        err = "no summary JSON line in output"
    elif not isinstance(rec.get("samples_per_second"), (int, float)) or rec["samples_per_second"] <= 0:
        err = "summary has no positive samples_per_second"
    return rec, err

def busy_before(framework, model, rep):
    try:
        return float(open(os.path.join(out_dir, f"{framework}-{model}-{rep}.busy")).read().split()[0])
    except (OSError, ValueError, IndexError):
        return None

def median(xs):
    return statistics.median(xs) if xs else None

def num(x):
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None

failed = False
rows, records = [], []
for m in models:
    res = {}
    loads = []
    for fw in FRAMEWORKS:
        sps, acc, errs, extra = [], [], [], {}
        for r in range(1, repeat + 1):
            la = busy_before(fw, m, r)
            if la is not None:
                loads.append(la)
            rec, err = load(fw, m, r)
            if err:
                errs.append(f"run {r}: {err}")
                continue
            sps.append(float(rec["samples_per_second"]))
            a = num(rec.get("test_accuracy"))
            if a is not None:
                acc.append(a)
            if fw != "fedmesh":
                extra["torch_version"] = rec.get("torch_version")
                extra["omp_wait_policy"] = rec.get("omp_wait_policy")
                extra["device_name"] = rec.get("device_name")
                extra["loader"] = rec.get("loader")
                if num(rec.get("median_step_ms")) is not None:
                    extra.setdefault("median_step_ms", []).append(rec["median_step_ms"])
                if num(rec.get("mean_step_ms")) is not None:
                    extra.setdefault("mean_step_ms", []).append(rec["mean_step_ms"])
                if num(rec.get("compile_seconds")) is not None:
                    extra.setdefault("compile_seconds", []).append(rec["compile_seconds"])
        res[fw] = dict(sps=sps, acc=acc, errs=errs, extra=extra)
    fm, pt = res["fedmesh"], res["pytorch"]
    fm_med, pt_med = median(fm["sps"]), median(pt["sps"])
    ratio = fm_med / pt_med if fm_med and pt_med else None
    target = TARGETS.get(m)
    meets = (ratio >= target) if (ratio is not None and target is not None) else None
    errors = [f"{fw} {e}" for fw in FRAMEWORKS for e in res[fw]["errs"]]
    if errors:
        failed = True
    rec = {
        "benchmark": "fedmesh_vs_pytorch",
        "model": m,
        "batch_size": batch,
        "threads": threads,
        "epochs": int(epochs) if epochs else None,
        "steps": int(steps) if steps else None,
        "repeat": repeat,
        "fedmesh_samples_per_second": fm_med,
        "pytorch_samples_per_second": pt_med,
        "ratio": ratio,
        "target": target,
        "meets_target": meets,
        "fedmesh_test_accuracy": median(fm["acc"]),
        "pytorch_test_accuracy": median(pt["acc"]),
        "fedmesh_runs_samples_per_second": fm["sps"],
        "pytorch_runs_samples_per_second": pt["sps"],
        "torch_version": pt["extra"].get("torch_version"),
        "pytorch_omp_wait_policy": pt["extra"].get("omp_wait_policy"),
        "pytorch_extra_args": torch_extra,
        "pytorch_median_step_ms": median(pt["extra"].get("median_step_ms", [])),
        "max_busy_cpus_before_runs": max(loads) if loads else None,
        "cpus": ncpu,
        "errors": errors,
        "device": device,
        "precision": precision,
    }
    if on_cuda:
        pc = res.get("pytorch-compile")
        pc_med = median(pc["sps"]) if pc else None
        rec.update({
            "device_name": pt["extra"].get("device_name") or (pc["extra"].get("device_name") if pc else None),
            "pytorch_loader": pt["extra"].get("loader"),
            "pytorch_mean_step_ms": median(pt["extra"].get("mean_step_ms", [])),
            "pytorch_compile_samples_per_second": pc_med,
            "ratio_compile": fm_med / pc_med if fm_med and pc_med else None,
            "pytorch_compile_runs_samples_per_second": pc["sps"] if pc else None,
            "pytorch_compile_seconds": median(pc["extra"].get("compile_seconds", [])) if pc else None,
            "pytorch_compile_accuracy": median(pc["acc"]) if pc else None,
        })
    records.append(rec)

def f(x, fmt):
    if x is None:
        width = "".join(ch for ch in fmt.split(".")[0] if ch.isdigit())
        return format("n/a", ">" + width)
    return format(x, fmt)

length = f"{steps} steps" if steps else f"{epochs} epoch(s)"
agg = f", median of {repeat}" if repeat > 1 else ""
if on_cuda:
    names = sorted({r.get("device_name") for r in records if r.get("device_name")})
    where = f"CUDA {', '.join(names) if names else 'GPU'}, {precision}"
else:
    where = "CPU" if precision == "fp32" else f"CPU, {precision}"
print(f"fedmesh vs PyTorch ({where}) -- batch {batch}, {threads} thread(s), {length}{agg}"
      + (f"; torch_train.py {torch_extra}" if torch_extra else ""))
hdr = f"{'model':<6} {'fedmesh sps':>12} {'pytorch sps':>12} {'ratio':>7} {'target':>8} {'status':<7} {'fm acc':>7} {'pt acc':>7}"
if on_cuda:
    hdr += f" {'compile sps':>12} {'vs compile':>10}"
print(hdr)
print("-" * len(hdr))
for r in records:
    status = "ERROR" if r["ratio"] is None else ("met" if r["meets_target"] else ("MISSED" if r["meets_target"] is False else "-"))
    line = (f"{r['model']:<6} {f(r['fedmesh_samples_per_second'], '12.1f')} {f(r['pytorch_samples_per_second'], '12.1f')} "
            f"{f(r['ratio'], '7.3f')} {'>= ' + f(r['target'], 'g'):>8} {status:<7} "
            f"{f(r['fedmesh_test_accuracy'], '7.4f')} {f(r['pytorch_test_accuracy'], '7.4f')}")
    if on_cuda:
        line += f" {f(r.get('pytorch_compile_samples_per_second'), '12.1f')} {f(r.get('ratio_compile'), '10.3f')}"
    print(line)
    for e in r["errors"]:
        print(f"  ! {r['model']}: {e}")
busy = [r for r in records if r["max_busy_cpus_before_runs"] is not None
        and r["max_busy_cpus_before_runs"] > 0.25]
if busy:
    worst = max(r["max_busy_cpus_before_runs"] for r in busy)
    print(f"WARNING: other processes kept {worst:.2f} of {ncpu} CPU(s) busy just before some runs; "
          "they compete for the cores, so these numbers are unreliable (rerun on an idle machine, "
          "or use --repeat).")
if on_cuda:
    print("(cuda: ratio = fedmesh / PyTorch eager, the target; vs compile = fedmesh / torch.compile; "
          "PyTorch leaves its warm-up steps and compile time out of the timing, fedmesh times every step)")
print()
for r in records:
    print(json.dumps(r))
sys.exit(1 if failed else 0)
PYEOF
rc=$?
if [[ $rc -ne 0 ]]; then log "some runs failed; raw outputs in $OUT_DIR"; trap - EXIT; fi
exit $rc
