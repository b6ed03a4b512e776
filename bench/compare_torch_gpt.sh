#!/usr/bin/env bash
# Compare fedmesh's language-model training throughput with PyTorch on this
# machine, in the same run: the same GPT-2-style decoder (byte
# tokenizer, King James Bible), batch size, AdamW (lr 1e-3, betas 0.9/0.999,
# eps 1e-8, wd 1e-4) at a constant learning rate, thread count, number of
# steps, device (CPU by default, or one CUDA GPU) and precision.  Prints a
# table and one JSON line per model with the ratio fedmesh/PyTorch (training
# tokens per second); with --device cuda also PyTorch with torch.compile and
# the MFU of every side.
#
# Missing a target is reported, never an error; the exit status is non-zero
# only when a run itself fails or the setup is broken.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: bench/compare_torch_gpt.sh [options]

Runs `fedmesh train --model M ... --schedule constant --json` and
bench/torch_gpt.py with identical settings for each model and prints
training tokens/s of both, the ratio fedmesh/PyTorch, the target and both
losses (last training batch, and held-out after the last step).  With
--device cuda PyTorch runs twice, eager and with --compile (torch.compile),
and the report adds the compiled tokens/s, the ratio fedmesh/torch.compile
("ratio_compile") and the MFU of each side (see bench/torch_gpt.py --help).
When fedmesh refuses the GPU run (exit 2: language models have no CUDA
attention yet), its side is reported as "refused" with the first line of
its message, the PyTorch numbers are still printed, and the exit status is 0.

Options:
  --models LIST        comma-separated models (default: gpt-nano,gpt-tiny; also gpt-small
                       and gpt2: vocabulary 50257, context 1024, width 768, 12 heads,
                       12 layers, 124M parameters)
  --batch-size B       windows per batch (default: 16)
  --threads T          compute threads for both frameworks (default: 2)
  --steps N            optimizer steps (default: 60; PyTorch excludes its first
                       step from the timing, fedmesh times all of them)
  --lr LR              constant learning rate for both (default: 1e-3)
  --test-limit W       evaluate on the first W held-out windows (default: 50)
  --repeat R           run each framework R times, alternating which goes
                       first, and report the median tokens/s (default: 1)
  --seed S             seed passed to both (default: 0)
  --device D           cpu (default) or cuda: `fedmesh train --device cuda` against
                       torch_gpt.py --device cuda, eager and --compile. Needs a python
                       whose torch has CUDA (Debian's python3-torch has not: give
                       --python); exits 2 at once when none is found
  --precision P        fp32 (default), bf16 or fp16 for both: fedmesh --precision P,
                       PyTorch autocast with fp32 master weights (+ GradScaler for
                       fp16 on cuda). Debian's torch 1.13 refuses fp16 on the CPU
  --no-compile         with --device cuda: skip the torch.compile run
  --same-init          every side starts from the same weights and sees the same batches:
                       PyTorch's seeded initialization is written once per model
                       (torch_gpt.py --write-init, fedmesh's parameter names), fedmesh reads
                       it (--init) and PyTorch walks fedmesh's window order
                       (--order fedmesh). The report then gives the held-out losses'
                       difference, which must stay within the precision's noise
  --peak-flops F       peak FLOP/s for the MFU (default: torch_gpt.py's table of dense
                       bf16 peaks by GPU name: H100 SXM 989e12, H100 PCIe 756e12,
                       H200 989e12, A100 312e12; else MFU "unknown")
  --fedmesh PATH       fedmesh binary (default: ${FEDMESH_BUILD_DIR:-build}/cli/fedmesh)
  --python PATH        python with torch+numpy (default: auto; python3, then /usr/bin/python3)
  --out-dir DIR        keep raw outputs of every run here (default: a temp dir, removed)
  --torch-tuned        run PyTorch with OMP_WAIT_POLICY=passive (a tuned baseline;
                       the default is PyTorch as a typical user runs it)
  --no-install         do not apt-get install python3-torch/python3-numpy/bible-kjv when missing
  -h, --help           show this help

Environment:
  FEDMESH_BUILD_DIR    fedmesh build directory, relative to the repository root
                       or absolute (default: build); if
                       $FEDMESH_BUILD_DIR/cli/fedmesh is missing, deploy/setup.sh is run
  FEDMESH_BIBLE        the bible program both sides read the corpus from (default
                       /usr/bin/bible, installed with bible-kjv when missing)
  FEDMESH_EXTRA_ARGS   extra arguments appended to every `fedmesh train` call
  TORCH_EXTRA_ARGS     extra arguments appended to every torch_gpt.py call (eager and
                       compiled), e.g. "--omp-wait-policy passive" (what --torch-tuned
                       adds), "--compile-mode max-autotune", "--warmup-steps 10"

Timing: PyTorch leaves its warm-up steps out (1 on the CPU; 5 on cuda, where
torch.compile compiles inside them; compile time is reported apart), fedmesh
times all its steps.

Target (fedmesh/PyTorch tokens/s): on the CPU >= 1.0 for every model; on cuda
>= 1.0 against torch.compile (against eager with --no-compile) and fedmesh's
MFU >= 40% where the GPU's peak is known.
EOF
}

die() { echo "compare_torch_gpt.sh: $*" >&2; exit 2; }
log() { echo "[compare_torch_gpt] $*" >&2; }

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/.." && pwd)"

MODELS="gpt-nano,gpt-tiny"
BATCH=16
THREADS=2
STEPS=60
LR="1e-3"
TEST_LIMIT=50
REPEAT=1
SEED=0
FEDMESH=""
PYTHON="${PYTHON:-}"
OUT_DIR=""
INSTALL=1
TORCH_TUNED=0
DEVICE=cpu
PRECISION=fp32
COMPILE=1
PEAK_FLOPS=""
SAME_INIT=0

need_arg() { [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a value"; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --models)     need_arg "$@"; MODELS="$2"; shift 2 ;;
    --batch-size) need_arg "$@"; BATCH="$2"; shift 2 ;;
    --threads)    need_arg "$@"; THREADS="$2"; shift 2 ;;
    --steps)      need_arg "$@"; STEPS="$2"; shift 2 ;;
    --lr)         need_arg "$@"; LR="$2"; shift 2 ;;
    --test-limit) need_arg "$@"; TEST_LIMIT="$2"; shift 2 ;;
    --repeat)     need_arg "$@"; REPEAT="$2"; shift 2 ;;
    --seed)       need_arg "$@"; SEED="$2"; shift 2 ;;
    --device)     need_arg "$@"; DEVICE="$2"; shift 2 ;;
    --precision)  need_arg "$@"; PRECISION="$2"; shift 2 ;;
    --no-compile) COMPILE=0; shift ;;
    --same-init)  SAME_INIT=1; shift ;;
    --peak-flops) need_arg "$@"; PEAK_FLOPS="$2"; shift 2 ;;
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
is_uint "$BATCH" || die "--batch-size must be a positive integer (got '$BATCH')"
is_uint "$THREADS" || die "--threads must be a positive integer (got '$THREADS')"
is_uint "$REPEAT" || die "--repeat must be a positive integer (got '$REPEAT')"
{ is_uint "$STEPS" && (( STEPS >= 2 )); } || die "--steps must be an integer >= 2 (got '$STEPS')"
is_uint "$TEST_LIMIT" || die "--test-limit must be a positive integer (got '$TEST_LIMIT')"
[[ "$LR" =~ ^[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?$ ]] || die "--lr must be a positive number (got '$LR')"
[[ "$SEED" =~ ^[0-9]+$ ]] || die "--seed must be a non-negative integer"
[[ "$DEVICE" == cpu || "$DEVICE" == cuda ]] || die "--device must be cpu or cuda (got '$DEVICE')"
[[ "$PRECISION" == fp32 || "$PRECISION" == bf16 || "$PRECISION" == fp16 ]] ||
  die "--precision must be fp32, bf16 or fp16 (got '$PRECISION')"
[[ -z "$PEAK_FLOPS" || "$PEAK_FLOPS" =~ ^[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?$ ]] ||
  die "--peak-flops must be a positive number (got '$PEAK_FLOPS')"
[[ "$DEVICE" == cuda ]] || COMPILE=0   # the torch.compile run belongs to the GPU comparison
IFS=',' read -r -a MODEL_LIST <<< "$MODELS"
[[ ${#MODEL_LIST[@]} -gt 0 ]] || die "--models is empty"
for m in "${MODEL_LIST[@]}"; do
  [[ "$m" == gpt-nano || "$m" == gpt-tiny || "$m" == gpt-small || "$m" == gpt2 ]] ||
    die "unknown model '$m' (expected gpt-nano, gpt-tiny, gpt-small or gpt2)"
done

cd "$REPO_ROOT"

if [[ $(id -u) -eq 0 ]]; then SUDO=()
elif command -v sudo >/dev/null 2>&1; then SUDO=(sudo)
else SUDO=(false); fi
APT_UPDATED=0
apt_install() {
  [[ $INSTALL -eq 1 ]] || die "missing $*; install them (apt-get install $*) or drop --no-install"
  [[ "${SUDO[*]}" != false ]] || die "$* missing and not root (no sudo) to apt-get install them"
  log "installing $* with apt-get"
  if [[ $APT_UPDATED -eq 0 ]]; then "${SUDO[@]}" apt-get update >&2; APT_UPDATED=1; fi
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@" >&2
}

# ---------------------------------------------------------------------------
# The corpus: Debian's King James Bible (both sides run `bible`).
# ---------------------------------------------------------------------------
# FEDMESH_BIBLE names another bible program for both (deploy/gpu_kit.sh).
if [[ -n "${FEDMESH_BIBLE:-}" ]]; then
  [[ -x "$FEDMESH_BIBLE" ]] || die "FEDMESH_BIBLE=$FEDMESH_BIBLE is not an executable bible program"
else
  [[ -x /usr/bin/bible ]] || apt_install bible-kjv
  [[ -x /usr/bin/bible ]] || die "/usr/bin/bible still missing after apt-get install bible-kjv"
fi

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
  apt_install python3-torch python3-numpy
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
REMOVE_OUT=0
if [[ -n "$OUT_DIR" ]]; then
  mkdir -p "$OUT_DIR"
else
  OUT_DIR="$(mktemp -d "${TMPDIR:-/tmp}/fedmesh-gpt-vs-torch.XXXXXX")"
  REMOVE_OUT=1
fi
# --same-init's weight files (GPT-2's are 500 MB) stay out of OUT_DIR, which
# may be kept or shipped.
INIT_DIR=""
(( SAME_INIT )) && INIT_DIR="$(mktemp -d "${TMPDIR:-/tmp}/fedmesh-gpt-init.XXXXXX")"
cleanup() {
  [[ -n "$INIT_DIR" ]] && rm -rf "$INIT_DIR"
  (( REMOVE_OUT )) && rm -rf "$OUT_DIR"
  return 0
}
trap cleanup EXIT

read -r -a FM_EXTRA <<< "${FEDMESH_EXTRA_ARGS:-}"
read -r -a PT_EXTRA <<< "${TORCH_EXTRA_ARGS:-}"
[[ $TORCH_TUNED -eq 1 ]] && PT_EXTRA=(--omp-wait-policy passive "${PT_EXTRA[@]}")
# --device / --precision for both sides; left out at their defaults (cpu,
# fp32) so that the CPU commands are exactly the ones of before.
DEV_ARGS=()
[[ "$DEVICE" != cpu ]] && DEV_ARGS+=(--device "$DEVICE")
[[ "$PRECISION" != fp32 ]] && DEV_ARGS+=(--precision "$PRECISION")
PEAK_ARGS=()
[[ -n "$PEAK_FLOPS" ]] && PEAK_ARGS=(--peak-flops "$PEAK_FLOPS")
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

# --same-init: the initial weights of model $1, written once by PyTorch.
init_file() { echo "$INIT_DIR/init-$1.safetensors"; }
write_init() {  # model
  local file; file="$(init_file "$1")"
  [[ -s "$file" ]] && return 0
  log "same start: PyTorch's initial $1 weights -> $file"
  "$PY" "$SCRIPT_DIR/torch_gpt.py" --model "$1" --seed "$SEED" --write-init "$file" \
    >"$OUT_DIR/init-$1.out" 2>"$OUT_DIR/init-$1.err" \
    || { tail -n 5 "$OUT_DIR/init-$1.err" >&2; die "torch_gpt.py --write-init failed for $1"; }
}

run_fedmesh() {  # model rep
  local out="$OUT_DIR/fedmesh-$1-$2" init_args=()
  (( SAME_INIT )) && init_args=(--init "$(init_file "$1")")
  busy_cpus >"$out.busy"
  log "fedmesh $1 run $2/$REPEAT (CPUs busy with other work just before: $(cat "$out.busy"))"
  if "$FEDMESH" train --model "$1" --steps "$STEPS" --batch-size "$BATCH" --threads "$THREADS" \
       --lr "$LR" --schedule constant --test-limit "$TEST_LIMIT" --seed "$SEED" --json \
       "${init_args[@]}" "${DEV_ARGS[@]}" "${FM_EXTRA[@]}" >"$out.out" 2>"$out.err"; then
    echo 0 >"$out.rc"
  else
    echo $? >"$out.rc"
    if [[ "$DEVICE" == cuda && $(cat "$out.rc") -eq 2 ]]; then
      log "fedmesh $1 run $2 refused --device cuda: $(grep -m1 . "$out.err" || true)"
    else
      log "fedmesh $1 run $2 FAILED (rc $(cat "$out.rc")); stderr tail:"; tail -n 5 "$out.err" >&2 || true
    fi
  fi
}
run_torch() {  # model rep [pytorch|pytorch-compile]
  local fw="${3:-pytorch}" compile_args=() init_args=()
  [[ "$fw" == pytorch-compile ]] && compile_args=(--compile)
  (( SAME_INIT )) && init_args=(--init "$(init_file "$1")" --order fedmesh)
  local out="$OUT_DIR/$fw-$1-$2"
  busy_cpus >"$out.busy"
  log "$fw $1 run $2/$REPEAT (CPUs busy with other work just before: $(cat "$out.busy"))"
  if "$PY" "$SCRIPT_DIR/torch_gpt.py" --model "$1" --steps "$STEPS" --batch-size "$BATCH" \
       --threads "$THREADS" --lr "$LR" --test-limit "$TEST_LIMIT" --seed "$SEED" \
       "${init_args[@]}" "${DEV_ARGS[@]}" "${compile_args[@]}" "${PEAK_ARGS[@]}" "${PT_EXTRA[@]}" >"$out.out" 2>"$out.err"; then
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
  (( SAME_INIT )) && write_init "$m"
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
"$PY" - "$OUT_DIR" "$MODELS" "$REPEAT" "$BATCH" "$THREADS" "$STEPS" "$LR" "$TEST_LIMIT" \
  "$(nproc 2>/dev/null || echo 0)" "${PT_EXTRA[*]}" "$DEVICE" "$PRECISION" "$COMPILE" "$SAME_INIT" <<'PYEOF'
import json, os, statistics, sys

(out_dir, models, repeat, batch, threads, steps, lr, test_limit, ncpu, torch_extra,
 device, precision, compile_run, same_init) = sys.argv[1:15]
same_init = same_init == "1"
ncpu = int(ncpu)
models = models.split(",")
repeat, batch, threads, steps, test_limit = int(repeat), int(batch), int(threads), int(steps), int(test_limit)
on_cuda = device == "cuda"
compile_run = compile_run == "1"
FRAMEWORKS = ("fedmesh", "pytorch") + (("pytorch-compile",) if compile_run else ())
TARGET = 1.0
MFU_TARGET = 0.40  # on cuda, where the GPU's peak is known

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

def num(x):
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None

def stderr_line(base, first=False):
    """The run's own error line: the first "fedmesh ..:" / "torch_gpt.py:"
    line of its stderr, else its first (first=True) or last non-empty line."""
    try:
        lines = [l.strip() for l in open(base + ".err", errors="replace") if l.strip()]
    except OSError:
        return None
    for l in lines:
        if l.startswith(("fedmesh", "torch_gpt.py:")):
            return l
    return (lines[0] if first else lines[-1]) if lines else None

def load(framework, model, rep):
    """(record, error, refusal): refusal is fedmesh's first message line when
    it declined --device cuda (exit 2)."""
    base = os.path.join(out_dir, f"{framework}-{model}-{rep}")
    try:
        rc = int(open(base + ".rc").read().strip())
    except (OSError, ValueError):
        rc = None
    if on_cuda and framework == "fedmesh" and rc == 2:
        return None, None, stderr_line(base, first=True) or "exit status 2"
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
    elif not (num(rec.get("tokens_per_second")) or 0) > 0:
        err = "summary has no positive tokens_per_second"
    return rec, err, None

def busy_before(framework, model, rep):
    try:
        return float(open(os.path.join(out_dir, f"{framework}-{model}-{rep}.busy")).read().split()[0])
    except (OSError, ValueError, IndexError):
        return None

def median(xs):
    return statistics.median(xs) if xs else None

failed = False
records = []
for m in models:
    res = {}
    loads = []
    for fw in FRAMEWORKS:
        tps, train_loss, test_loss, errs, refusals, extra = [], [], [], [], [], {}
        for r in range(1, repeat + 1):
            la = busy_before(fw, m, r)
            if la is not None:
                loads.append(la)
            rec, err, refusal = load(fw, m, r)
            if refusal:
                refusals.append(refusal)
                continue
            if err:
                errs.append(f"run {r}: {err}")
                continue
            tps.append(float(rec["tokens_per_second"]))
            tl = num(rec.get("train_loss" if fw == "fedmesh" else "final_train_loss"))
            if tl is not None:
                train_loss.append(tl)
            el = num(rec.get("test_loss"))
            if el is not None:
                test_loss.append(el)
            if fw != "fedmesh":
                extra["torch_version"] = rec.get("torch_version")
                extra["omp_wait_policy"] = rec.get("omp_wait_policy")
                extra["attention"] = rec.get("attention")
                for k in ("device_name", "flops_per_token", "peak_flops", "peak_flops_source", "parameters"):
                    if rec.get(k) is not None:
                        extra[k] = rec[k]
                if num(rec.get("median_step_ms")) is not None:
                    extra.setdefault("median_step_ms", []).append(rec["median_step_ms"])
                for k in ("mean_step_ms", "compile_seconds", "mfu"):
                    if num(rec.get(k)) is not None:
                        extra.setdefault(k, []).append(rec[k])
            else:
                if num(rec.get("unigram_bits_per_byte")) is not None:
                    extra["unigram_bits_per_byte"] = rec["unigram_bits_per_byte"]
        res[fw] = dict(tps=tps, train_loss=train_loss, test_loss=test_loss, errs=errs,
                       refusals=refusals, extra=extra)
    fm, pt = res["fedmesh"], res["pytorch"]
    fm_med, pt_med = median(fm["tps"]), median(pt["tps"])
    ratio = fm_med / pt_med if fm_med and pt_med else None
    meets = (ratio >= TARGET) if ratio is not None else None
    errors = [f"{fw} {e}" for fw in FRAMEWORKS for e in res[fw]["errs"]]
    if errors:
        failed = True
    rec = {
        "benchmark": "fedmesh_vs_pytorch_lm",
        "model": m,
        "batch_size": batch,
        "threads": threads,
        "steps": steps,
        "lr": float(lr),
        "schedule": "constant",
        "test_limit": test_limit,
        "repeat": repeat,
        "fedmesh_tokens_per_second": fm_med,
        "pytorch_tokens_per_second": pt_med,
        "ratio": ratio,
        "target": TARGET,
        "meets_target": meets,
        "fedmesh_train_loss": median(fm["train_loss"]),
        "pytorch_train_loss": median(pt["train_loss"]),
        "fedmesh_test_loss": median(fm["test_loss"]),
        "pytorch_test_loss": median(pt["test_loss"]),
        "unigram_bits_per_byte": fm["extra"].get("unigram_bits_per_byte"),
        "fedmesh_runs_tokens_per_second": fm["tps"],
        "pytorch_runs_tokens_per_second": pt["tps"],
        "torch_version": pt["extra"].get("torch_version"),
        "pytorch_attention": pt["extra"].get("attention"),
        "pytorch_omp_wait_policy": pt["extra"].get("omp_wait_policy"),
        "pytorch_extra_args": torch_extra,
        "pytorch_median_step_ms": median(pt["extra"].get("median_step_ms", [])),
        "max_busy_cpus_before_runs": max(loads) if loads else None,
        "cpus": ncpu,
        "errors": errors,
        "device": device,
        "precision": precision,
        "same_init": same_init,
    }
    # With the same start, the held-out losses of fedmesh and PyTorch (eager)
    # after the same steps differ only by the arithmetic's rounding.
    if rec["fedmesh_test_loss"] is not None and rec["pytorch_test_loss"] is not None:
        rec["test_loss_difference"] = rec["fedmesh_test_loss"] - rec["pytorch_test_loss"]
    if on_cuda:
        pc = res.get("pytorch-compile")
        pc_med = median(pc["tps"]) if pc else None
        ratio_compile = fm_med / pc_med if fm_med and pc_med else None
        info = dict(pt["extra"])
        if pc:
            info.update({k: v for k, v in pc["extra"].items() if k not in info})
        fpt, peak = num(info.get("flops_per_token")), num(info.get("peak_flops"))
        fm_mfu = fm_med * fpt / peak if (fm_med and fpt and peak) else None
        # The cuda target: >= 1.0x torch.compile (eager with --no-compile) and
        # fedmesh's MFU >= 40% where the peak is known.
        against = ratio_compile if pc else ratio
        meets_ratio = (against >= TARGET) if against is not None else None
        meets_mfu = (fm_mfu >= MFU_TARGET) if fm_mfu is not None else None
        if meets_ratio is None:
            meets_cuda = None
        elif meets_mfu is None:
            meets_cuda = meets_ratio
        else:
            meets_cuda = meets_ratio and meets_mfu
        rec.update({
            "meets_target": meets_cuda,
            "target_against": "torch.compile" if pc else "pytorch eager",
            "mfu_target": MFU_TARGET,
            "fedmesh_refused": fm["refusals"][0] if fm["refusals"] else None,
            "device_name": info.get("device_name"),
            "parameters": info.get("parameters"),
            "flops_per_token": fpt,
            "peak_flops": peak,
            "peak_flops_source": info.get("peak_flops_source"),
            "fedmesh_mfu": fm_mfu,
            "pytorch_mfu": median(pt["extra"].get("mfu", [])),
            "pytorch_mean_step_ms": median(pt["extra"].get("mean_step_ms", [])),
            "pytorch_compile_tokens_per_second": pc_med,
            "ratio_compile": ratio_compile,
            "pytorch_compile_mfu": median(pc["extra"].get("mfu", [])) if pc else None,
            "pytorch_compile_runs_tokens_per_second": pc["tps"] if pc else None,
            "pytorch_compile_seconds": median(pc["extra"].get("compile_seconds", [])) if pc else None,
            "pytorch_compile_train_loss": median(pc["train_loss"]) if pc else None,
            "pytorch_compile_test_loss": median(pc["test_loss"]) if pc else None,
        })
    records.append(rec)

def f(x, fmt):
    if x is None:
        width = "".join(ch for ch in fmt.split(".")[0] if ch.isdigit())
        return format("n/a", ">" + width)
    return format(x, fmt)

agg = f", median of {repeat}" if repeat > 1 else ""
if not on_cuda:
    where = "CPU" if precision == "fp32" else f"CPU, {precision}"
    print(f"fedmesh vs PyTorch ({where}, language models) -- batch {batch}, {threads} thread(s), {steps} steps, "
          f"AdamW lr {lr} constant{agg}" + (f"; torch_gpt.py {torch_extra}" if torch_extra else ""))
    hdr = (f"{'model':<9} {'fedmesh tok/s':>13} {'pytorch tok/s':>13} {'ratio':>7} {'target':>8} {'status':<7} "
           f"{'fm train':>8} {'pt train':>8} {'fm test':>8} {'pt test':>8}")
    print(hdr)
    print("-" * len(hdr))
    for r in records:
        status = "ERROR" if r["ratio"] is None else ("met" if r["meets_target"] else "MISSED")
        print(f"{r['model']:<9} {f(r['fedmesh_tokens_per_second'], '13.0f')} {f(r['pytorch_tokens_per_second'], '13.0f')} "
              f"{f(r['ratio'], '7.3f')} {'>= ' + f(r['target'], 'g'):>8} {status:<7} "
              f"{f(r['fedmesh_train_loss'], '8.3f')} {f(r['pytorch_train_loss'], '8.3f')} "
              f"{f(r['fedmesh_test_loss'], '8.3f')} {f(r['pytorch_test_loss'], '8.3f')}")
        for e in r["errors"]:
            print(f"  ! {r['model']}: {e}")
else:
    names = sorted({r.get("device_name") for r in records if r.get("device_name")})
    print(f"fedmesh vs PyTorch (CUDA {', '.join(names) if names else 'GPU'}, {precision}, language models) -- "
          f"batch {batch}, {steps} steps, AdamW lr {lr} constant{agg}"
          + (f"; torch_gpt.py {torch_extra}" if torch_extra else ""))
    def pct(x):
        return format("unknown", ">7") if x is None else format(f"{100 * x:.1f}%", ">7")
    hdr = (f"{'model':<9} {'fedmesh tok/s':>13} {'eager tok/s':>13} {'compile tok/s':>13} {'ratio':>7} "
           f"{'vs comp':>7} {'status':<8} {'fm MFU':>7} {'eag MFU':>7} {'cmp MFU':>7} "
           f"{'fm test':>8} {'pt test':>8}")
    print(hdr)
    print("-" * len(hdr))
    for r in records:
        if r["fedmesh_refused"]:
            status = "refused"
        elif r["errors"] or r["meets_target"] is None:
            status = "ERROR"
        else:
            status = "met" if r["meets_target"] else "MISSED"
        fm_tps = format("refused", ">13") if r["fedmesh_refused"] else f(r["fedmesh_tokens_per_second"], "13.0f")
        fm_mfu = format("-", ">7") if r["fedmesh_refused"] else pct(r["fedmesh_mfu"])
        print(f"{r['model']:<9} {fm_tps} {f(r['pytorch_tokens_per_second'], '13.0f')} "
              f"{f(r['pytorch_compile_tokens_per_second'], '13.0f')} {f(r['ratio'], '7.3f')} "
              f"{f(r['ratio_compile'], '7.3f')} {status:<8} {fm_mfu} {pct(r['pytorch_mfu'])} "
              f"{pct(r['pytorch_compile_mfu'])} {f(r['fedmesh_test_loss'], '8.3f')} "
              f"{f(r['pytorch_test_loss'], '8.3f')}")
        if r["fedmesh_refused"]:
            print(f"  fedmesh refused --device cuda: {r['fedmesh_refused']}")
        for e in r["errors"]:
            print(f"  ! {r['model']}: {e}")
    srcs = sorted({r.get("peak_flops_source") for r in records if r.get("peak_flops_source")})
    print(f"(target: fedmesh >= {TARGET:g}x "
          f"{'torch.compile' if compile_run else 'PyTorch eager'} and fedmesh MFU >= {100 * MFU_TARGET:.0f}% where "
          f"the peak is known; MFU = tokens/s x (6 x parameters less wpe + 12 x layers x context x width) / peak; "
          f"peak: {', '.join(srcs) if srcs else 'unknown'}; PyTorch leaves its warm-up steps and compile time out "
          "of the timing, fedmesh times every step)")
if same_init:
    print("(losses: nats per byte; train = the last training batch, test = the first "
          f"{test_limit} held-out windows after the last step; every side started from PyTorch's "
          "initial weights and walked fedmesh's window order (--same-init))")
    for r in records:
        d = r.get("test_loss_difference")
        if d is not None:
            rel = abs(d) / abs(r["pytorch_test_loss"]) if r["pytorch_test_loss"] else None
            line = (f"same start, {r['model']}: held-out loss fedmesh {r['fedmesh_test_loss']:.5f}, "
                    f"PyTorch {r['pytorch_test_loss']:.5f} (difference {d:+.5f}, {100 * rel:.3f}%)")
            if r.get("pytorch_compile_test_loss") is not None:
                line += f", torch.compile {r['pytorch_compile_test_loss']:.5f}"
            print(line)
else:
    print("(losses: nats per byte; train = the last training batch, test = the first "
          f"{test_limit} held-out windows after the last step; different initial weights and "
          "shuffles, so only roughly comparable: --same-init starts both sides alike)")
busy = [r for r in records if r["max_busy_cpus_before_runs"] is not None
        and r["max_busy_cpus_before_runs"] > 0.25]
if busy:
    worst = max(r["max_busy_cpus_before_runs"] for r in busy)
    print(f"WARNING: other processes kept {worst:.2f} of {ncpu} CPU(s) busy just before some runs; "
          "they compete for the cores, so these numbers are unreliable (rerun on an idle machine, "
          "or use --repeat).")
print()
for r in records:
    print(json.dumps(r))
sys.exit(1 if failed else 0)
PYEOF
rc=$?
if [[ $rc -ne 0 ]]; then log "some runs failed; raw outputs in $OUT_DIR"; REMOVE_OUT=0; fi
exit $rc
