#!/usr/bin/env bash
# fedmesh: a kit for a GPU machine that has none of our Debian libraries.
#
# A GPU machine with CUDA, NCCL and a CUDA PyTorch but no package registry
# has none of the Debian libraries fedmesh links (ZeroMQ, libsodium, Cap'n
# Proto, SQLite, OpenBLAS, Gloo, ...). This script packs, on a Debian 12
# machine, everything the CUDA tests and the GPU benchmarks need into one
# git-ignored folder that is copied to the GPU machine with the source tree,
# and runs them there from it:
#   pack  (here, on Debian 12): the fedmesh binary and the CUDA test binaries
#         of a CUDA-enabled build, stripped; the Debian packages (.deb, the
#         installed versions, fetched with apt-get download) of every shared
#         library they load that a GPU image is not expected to have, and of
#         the King James Bible; a small slice of Fashion-MNIST for the tests
#   run   (there): unpacks the packages with dpkg -x into a private prefix
#         inside the kit (never into /), checks that every binary's libraries
#         resolve, then runs the chosen steps, logging each to --log-dir
set -euo pipefail

ROOT=$(cd -- "$(dirname -- "$(readlink -f -- "${BASH_SOURCE[0]}")")/.." && pwd -P)
KIT=$ROOT/.deps/gpu-kit

# The binaries the kit carries, relative to the build directory.
BINARIES=(cli/fedmesh tests/test_device tests/test_cuda_ops tests/test_compression_kernels_cuda
          tests/test_device_training_cuda tests/test_communicator_nccl)
# Libraries a GPU image has itself (the C and C++ runtimes) or that must come
# from its own CUDA install (the driver, the toolkit, NCCL): never packed.
HOST_LIBRARIES='^(linux-vdso|ld-linux-x86-64|libc|libm|libpthread|libdl|librt|libutil|libresolv|libanl|libstdc\+\+|libgcc_s|libcuda|libcudart|libcublas|libcublasLt|libnccl)\.so'
# Packages packed whatever the binaries link: the corpus of the language models.
EXTRA_PACKAGES=(bible-kjv bible-kjv-text)
# Fashion-MNIST images per split in the kit (test_device_training_cuda uses 512 and 256).
FASHION_IMAGES=1024
# The most the kit and the source tree may weigh together (what is copied to the GPU machine).
CARRY_LIMIT_BYTES=$((64 << 20))
STEPS_DEFAULT=check,doctor,smoke,tests,sanitize,train,federation,throughput,profile,kernels,gpt2

usage() {
  cat <<EOF
Usage: deploy/gpu_kit.sh pack [--build DIR] [--kit DIR]
       deploy/gpu_kit.sh run  [--kit DIR] [--steps LIST] [--log-dir DIR] [--gpt2-steps N]
                              [--quiet] [--deadline SECONDS] [--bundle FILE] [--sanitize-filter RE]

pack   On Debian 12, after a CUDA-enabled build (deploy/setup.sh where nvcc is
       found): copies and strips ${BINARIES[*]}
       into KIT/bin, downloads (apt-get download: the installed versions, or
       the mirror's current one where it no longer has them) the Debian
       packages of every shared library they load other than the C/C++
       runtime and CUDA's own, plus ${EXTRA_PACKAGES[*]}, into KIT/debs, cuts
       the first $FASHION_IMAGES images of each Fashion-MNIST split into
       KIT/data/fashion-mnist, and writes KIT/MANIFEST. Fails if the kit and the
       working tree are over 64 MiB together.
run    On the GPU machine, from the repository root: dpkg -x every package into
       a private prefix (a temporary folder, removed at the end; never /), then
       runs the steps in LIST (default $STEPS_DEFAULT):
         check    every binary's libraries resolve (the prefix, CUDA's lib64, the
                  image's own C/C++ runtime); always runs first
         doctor   fedmesh doctor --json (what the build and the machine have)
         smoke    fedmesh train --model gpt-nano --steps 2 on the CPU: the kit's
                  bible program (FEDMESH_BIBLE) gives the corpus
         tests    the CUDA test binaries (they skip without a GPU)
         sanitize compute-sanitizer memcheck over the CUDA op and compression
                  tests, racecheck over the tests of the kernels with shared
                  memory (chunk top-k sort, block scales, Gram-Schmidt,
                  attention rows, reductions); says so when the machine has no
                  compute-sanitizer
         train    fedmesh train --device cuda against --device cpu, same seed,
                  steps and data: mlp and cnn in fp32/bf16/fp16 (test accuracy)
                  and gpt-nano in fp32/bf16 (held-out loss); a table with the
                  verdict of each pair (deploy/gpu_kit_report.py)
         federation an aggregator + 2 sites with training.device = "cuda" and
                  top-k compressed on the device, beside the same federation on
                  the CPU: their last test accuracies within 1 point
         throughput bench/compare_torch.sh --device cuda, mlp and cnn in fp32
                  and bf16 against PyTorch eager on the same GPU
         profile  fedmesh train --model gpt2 --device cuda --precision bf16
                  --batch-size 16 --steps 20 --profile --json
         kernels  Nsight Compute (ncu) times every kernel of two GPT-2 bf16
                  steps: LOG_DIR/gpt2-kernels.{ncu-rep,csv} and a table of the
                  kernels by total time; says so when there is no ncu
         batchscan fedmesh train --model gpt2 --device cuda --profile at batch
                  sizes 4, 8, 16, 24: whether a step is bound by the host or the device
         gpt2     bench/compare_torch_gpt.sh --device cuda --precision bf16
                  --models gpt2 --batch-size 16 --steps N --test-limit 20 --same-init
                  (fedmesh vs PyTorch eager and torch.compile, MFU; all three
                  from PyTorch's initial weights in fedmesh's batch order)
       Each step's output goes to LOG_DIR/STEP.log; the last lines are a table
       of the steps and their exit codes. Exit status: nonzero if any failed.
       All the steps take about 8 minutes on an H200; --deadline bounds a run
       and --steps splits it.

Options:
  --build DIR       build directory (default: \$FEDMESH_BUILD_DIR or build)
  --kit DIR         kit directory (default: .deps/gpu-kit, git-ignored)
  --steps LIST      comma-separated steps of run
  --log-dir DIR     where run writes its logs (default: \$OUT when set, else KIT/logs)
  --gpt2-steps N    optimizer steps of the gpt2 comparison (default: 50)
  --quiet           write each step's output to its log only and print its
                    verdict lines (and its end when it failed)
  --deadline S      the steps end by S seconds into the run: one still running
                    then is stopped with what it started, and none starts in
                    its last 20 s (each said in the summary; the run then exits
                    nonzero), so that the report is written before a time
                    limit of the machine's
  --sanitize-filter RE  the sanitize step runs only its runs ("TOOL TEST FILTER")
                    that match the extended regular expression RE
  --bundle FILE     at the end, tar.gz the log directory into FILE; LOG_DIR
                    also gets report.json (deploy/gpu_kit_report.py)
  -h, --help        show this help

On the GPU machine, from the source tree with the kit in .deps/gpu-kit, for example:
  deploy/gpu_kit.sh run --quiet --deadline 380 --log-dir /tmp/kit-logs --bundle /tmp/kit-logs.tar.gz
EOF
}

die() { printf 'gpu_kit: error: %s\n' "$*" >&2; exit 2; }
say() { printf '[gpu_kit] %s\n' "$*" >&2; }

# ---------------------------------------------------------------------------
# pack
# ---------------------------------------------------------------------------

# "SONAME PATH" for every shared library BINARY loads (ldd: the whole closure).
library_paths() {
  ldd "$1" | awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }'
}

# The Debian package that owns a library file (merged /usr: try both spellings).
owning_package() {
  local path=$1 real candidate
  real=$(readlink -f -- "$path")
  for candidate in "$path" "$real" "${path#/usr}" "${real#/usr}" "/usr$path" "/usr$real"; do
    dpkg-query -S -- "$candidate" 2>/dev/null | head -n1 | cut -d: -f1 && return 0
  done
  return 1
}

pack() {
  local build=$1
  [[ -d $build ]] || die "build directory $build does not exist (run deploy/setup.sh first)"
  [[ -x $build/tests/test_device_training_cuda ]] ||
    die "$build is not a CUDA build ($build/tests/test_device_training_cuda is missing): configure it where nvcc is found (-Dcuda=enabled)"
  command -v apt-get >/dev/null && command -v dpkg-query >/dev/null || die "pack needs Debian's apt-get and dpkg-query"
  rm -rf "$KIT/bin" "$KIT/debs" "$KIT/data" "$KIT/logs"
  mkdir -p "$KIT/bin" "$KIT/debs" "$KIT/data/fashion-mnist"

  local binary name
  for binary in "${BINARIES[@]}"; do
    [[ -x $build/$binary ]] || die "$build/$binary is missing: build it first (ninja -C $build)"
    name=$(basename "$binary")
    # Debug sections out, the symbol table kept: backtraces name functions.
    strip --strip-debug -o "$KIT/bin/$name" "$build/$binary"
  done

  # The packages of every library the binaries and the bible program load.
  local -A libraries=() packages=()
  local soname path package
  for binary in "$KIT"/bin/* /usr/bin/bible; do
    while read -r soname path; do
      [[ $soname =~ $HOST_LIBRARIES ]] || libraries[$path]=$binary
    done < <(library_paths "$binary")
  done
  # One dpkg-query for the files the paths resolve to; owning_package for
  # any it does not find.
  local -A owned=()
  local -a real_paths=()
  local line
  for path in "${!libraries[@]}"; do real_paths+=("$(readlink -f -- "$path")"); done
  while IFS= read -r line; do
    packages[${line%%:*}]=1
    owned[${line#*: }]=1
  done < <(dpkg-query -S -- "${real_paths[@]}" 2>/dev/null)
  for path in "${!libraries[@]}"; do
    [[ -n ${owned[$(readlink -f -- "$path")]:-} ]] && continue
    package=$(owning_package "$path") || die "no Debian package owns $path (loaded by ${libraries[$path]})"
    packages[$package]=1
  done
  for package in "${EXTRA_PACKAGES[@]}"; do packages[$package]=1; done

  # The installed versions, in one apt-get call; a version the mirror no
  # longer has is replaced by its current one (same library, a newer Debian
  # revision), said, and the call made again.
  say "downloading ${#packages[@]} packages: ${!packages[*]}"
  local -A wanted=()
  for package in "${!packages[@]}"; do
    wanted[$package]="$package=$(dpkg-query -W -f '${Version}' "$package" 2>/dev/null)" ||
      die "$package is not installed here (apt-get install $package)"
  done
  local attempt errors stale updated=0
  for attempt in 1 2 3 4; do
    errors=$(cd "$KIT/debs" && apt-get download -q "${wanted[@]}" 2>&1 >/dev/null) && break
    [[ $attempt -lt 4 ]] || die "apt-get download failed: $errors"
    stale=$(sed -n "s/.*Can't find a source to download version '\([^']*\)' of '\([^':]*\)[:']*.*/\2 \1/p" <<< "$errors")
    if [[ -n $stale ]]; then
      while read -r package version; do
        say "$package $version is no longer on the mirror: packing its current version"
        wanted[$package]=$package
      done <<< "$stale"
    elif [[ $updated -eq 0 && $(id -u) -eq 0 ]]; then
      say "apt-get download failed ($errors); apt-get update and again"
      apt-get update -q >&2 || die "apt-get update failed"
      updated=1
    else
      die "apt-get download failed: $errors (run apt-get update, then pack again)"
    fi
  done

  # A slice of Fashion-MNIST: the same IDX format with fewer images.
  python3 - "${FEDMESH_FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}" "$KIT/data/fashion-mnist" \
    "$FASHION_IMAGES" <<'PY'
import gzip, struct, sys
source, target, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
for split in ("train", "t10k"):
    for kind, header_words, item_bytes in (("images", 4, 28 * 28), ("labels", 2, 1)):
        name = f"{split}-{kind}-idx{header_words - 1}-ubyte.gz"
        with gzip.open(f"{source}/{name}", "rb") as f:
            header = list(struct.unpack(f">{header_words}I", f.read(4 * header_words)))
            header[1] = min(header[1], count)
            body = f.read(header[1] * item_bytes)
        with gzip.open(f"{target}/{name}", "wb") as f:
            f.write(struct.pack(f">{header_words}I", *header) + body)
PY

  {
    echo "fedmesh GPU kit, packed $(date -u +%Y-%m-%dT%H:%M:%SZ) from commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "build: $build"
    echo "binaries:"; (cd "$KIT/bin" && sha256sum -- *)
    echo "packages:"; ls "$KIT/debs"
  } > "$KIT/MANIFEST"

  local kit_bytes tree_bytes
  kit_bytes=$(du -sb "$KIT" | cut -f1)
  tree_bytes=$(cd "$ROOT" && git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -n1 | cut -f1)
  say "kit: $KIT, $((kit_bytes >> 20)) MiB; working tree $((tree_bytes >> 20)) MiB; one call carries at most 64 MiB"
  ((kit_bytes + tree_bytes <= CARRY_LIMIT_BYTES)) || die "the kit and the working tree are over 64 MiB: they will not travel"
  echo "packed $KIT: ${#BINARIES[@]} binaries, ${#packages[@]} packages, Fashion-MNIST x $FASHION_IMAGES"
}

# ---------------------------------------------------------------------------
# run
# ---------------------------------------------------------------------------

# dpkg -x into the private prefix PREFIX (a temporary folder, so that the
# kit itself stays small enough to travel); python's ar/tar reader where
# dpkg is absent.
unpack() {
  local deb
  for deb in "$KIT"/debs/*.deb; do
    if command -v dpkg-deb >/dev/null; then
      dpkg-deb -x "$deb" "$PREFIX" || die "dpkg -x $deb failed"
    else
      python3 - "$deb" "$PREFIX" <<'PY' || die "cannot unpack $deb"
import io, sys, tarfile
data, target = open(sys.argv[1], "rb").read(), sys.argv[2]
assert data[:8] == b"!<arch>\n", "not an ar archive"
offset = 8
while offset < len(data):
    name, size = data[offset:offset + 16].decode().strip().rstrip("/"), int(data[offset + 48:offset + 58])
    if name.startswith("data.tar"):
        tarfile.open(fileobj=io.BytesIO(data[offset + 60:offset + 60 + size])).extractall(target)
        break
    offset += 60 + size + (size & 1)
else:
    sys.exit("no data.tar member")
PY
    fi
  done
}

# The library path of the kit's binaries: the private prefix first, then CUDA's.
kit_library_path() {
  local dirs=() dir
  for dir in "$PREFIX"/usr/lib/x86_64-linux-gnu "$PREFIX"/usr/lib/x86_64-linux-gnu/* \
             "$PREFIX"/lib/x86_64-linux-gnu "$PREFIX"/usr/lib /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [[ -d $dir ]] && dirs+=("$dir")
  done
  # NCCL may come with PyTorch's wheels rather than the toolkit.
  if [[ ! -e /usr/local/cuda/lib64/libnccl.so.2 ]]; then
    dir=$(find / -xdev -name 'libnccl.so.2' -path '*nvidia*' -printf '%h\n' 2>/dev/null | head -n1 || true)
    [[ -n $dir ]] && dirs+=("$dir")
  fi
  local IFS=:
  echo "${dirs[*]}"
}

# Every library of every binary resolves, from the prefix unless it is the
# host's C/C++ runtime or CUDA's, and no symbol version is missing (a host
# C library older than Debian 12's, say).
check_libraries() {
  local binary missing=0 soname path listing
  for binary in "$KIT"/bin/* "$PREFIX"/usr/bin/bible; do
    listing=$(LD_LIBRARY_PATH=$LIBRARY_PATH_KIT ldd "$binary" 2>&1) || true
    if grep -q "version .* not found" <<< "$listing"; then
      printf 'gpu_kit: %s: %s\n' "$binary" "$(grep "version .* not found" <<< "$listing" | head -n 3)" >&2
      missing=1
    fi
    while read -r soname path; do
      if [[ $path == "not" ]]; then
        printf 'gpu_kit: %s: %s is not found\n' "$binary" "$soname" >&2; missing=1
      elif [[ ! $soname =~ $HOST_LIBRARIES && $path != "$PREFIX"/* ]]; then
        printf 'gpu_kit: %s: %s comes from %s, not from the kit\n' "$binary" "$soname" "$path" >&2; missing=1
      fi
    done < <(awk '$2 == "=>" { print $1, $3 }' <<< "$listing")
  done
  [[ $missing -eq 0 ]] || return 1
  echo "every library of $(ls "$KIT/bin" | wc -l) binaries and bible resolves (kit or host C/C++/CUDA)"
}

# The path of one of CUDA's tools (on PATH, in the toolkit, or Nsight
# Compute's own folder), or nothing.
cuda_tool() {
  command -v "$1" || ls /usr/local/cuda/bin/"$1" /opt/nvidia/nsight-compute/*/"$1" 2>/dev/null | head -n1 || true
}

# compute-sanitizer over the CUDA op tests: memcheck over every test, racecheck
# over those whose kernels use shared memory of ours (the chunk top-k sort,
# block scales, Gram-Schmidt, attention rows, reductions; the global top-k's
# only shared memory is CUB's radix sort). Says so when the image has none.
sanitize_step() {
  local sanitizer
  sanitizer=$(cuda_tool compute-sanitizer)
  if [[ -z $sanitizer ]]; then echo "compute-sanitizer: not on this machine (skipped)"; return 0; fi
  # The sanitizer runs the real binaries (the wrappers are shell scripts).
  local status=0 code tool test filter
  local -a runs=(
    "memcheck test_cuda_ops *"
    "memcheck test_compression_kernels_cuda *"
    "racecheck test_compression_kernels_cuda *ChunkTopK*"
    "racecheck test_compression_kernels_cuda *QuantizeIsBitIdentical*:*OrthonormalizeColumnsMatches*"
    "racecheck test_cuda_ops *Attention*:*LayerNorm*:*CrossEntropy*:*SquaredNorm*:*BiasGradients*:*GroupNorm*:*PlaneMean*"
  )
  local line
  for line in "${runs[@]}"; do
    [[ $line =~ $SANITIZE_FILTER ]] || continue
    read -r tool test filter <<< "$line"
    echo "== compute-sanitizer --tool $tool $test --gtest_filter=$filter"
    code=0
    # Under racecheck the compression tests run fewer cases
    # (FEDMESH_TEST_SANITIZER): at their full sizes one outlasted 120 s.
    # memcheck runs every case.
    local -a fewer=()
    [[ $tool == racecheck ]] && fewer=(FEDMESH_TEST_SANITIZER=1)
    env "${fewer[@]}" LD_LIBRARY_PATH="$LIBRARY_PATH_KIT" timeout 120 "$sanitizer" --tool "$tool" --error-exitcode 99 \
      "$KIT/bin/$test" --gtest_color=no --gtest_brief=1 "--gtest_filter=$filter" || code=$?
    case $code in 0) echo "RESULT $tool $test: clean" ;;
                  124) echo "RESULT $tool $test: TIMED OUT (120 s)"; status=1 ;;
                  *) echo "RESULT $tool $test: FAILED (exit $code)"; status=1 ;; esac
  done
  return $status
}

# Nsight Compute's time of every kernel of two GPT-2 bf16 training steps
# (their initialization and a one-window evaluation around them), summed by
# kernel: where the device's step time goes.
kernels_step() {
  local ncu
  ncu=$(cuda_tool ncu)
  if [[ -z $ncu ]]; then echo "ncu: not on this machine (skipped)"; return 0; fi
  local report=$LOG_DIR/gpt2-kernels
  LD_LIBRARY_PATH=$LIBRARY_PATH_KIT timeout 100 "$ncu" --metrics gpu__time_duration.sum --cache-control none \
    --clock-control none --launch-count 4000 -f -o "$report" \
    "$KIT/bin/fedmesh" train --model gpt2 --device cuda --precision bf16 --batch-size 16 --steps 2 \
    --test-limit 1 --json || return 1
  "$ncu" --import "$report.ncu-rep" --csv --page raw > "$report.csv" || return 1
  python3 "$ROOT/deploy/gpu_kit_report.py" kernels "$report.csv"
}

# fedmesh train on the GPU against the CPU, same seed, steps and data: mlp
# and cnn in fp32, bf16 and fp16, and gpt-nano. One JSON summary per run in
# LOG_DIR/train/; the table (and report.json's "train") compares them.
train_step() {
  local model precision device code status=0 out
  mkdir -p "$LOG_DIR/train"
  local -a runs=(mlp:fp32 mlp:bf16 mlp:fp16 cnn:fp32 cnn:bf16 cnn:fp16 gpt-nano:fp32 gpt-nano:bf16)
  local run
  for run in "${runs[@]}"; do
    model=${run%%:*} precision=${run#*:}
    for device in cpu cuda; do
      out=$LOG_DIR/train/$model-$precision-$device.jsonl
      local -a args=(--model "$model" --device "$device" --precision "$precision" --seed 7 --json --threads 8)
      if [[ $model == gpt-* ]]; then
        args+=(--steps 60 --batch-size 8 --test-limit 64 --log-every 20)
      else
        args+=(--data "$DATA" --steps 150 --batch-size 64 --test-limit 1024 --log-every 50)
      fi
      code=0
      timeout 60 "$WRAPPED/fedmesh" train "${args[@]}" > "$out" 2> "${out%.jsonl}.err" || code=$?
      echo "$model $precision $device: exit $code"
      [[ $code -eq 0 ]] || { tail -n 5 "${out%.jsonl}.err"; [[ $device == cpu && $precision == fp16 ]] || status=1; }
    done
  done
  python3 "$ROOT/deploy/gpu_kit_report.py" train "$LOG_DIR/train" || status=1
  return $status
}

# A federation on the GPU: an aggregator and 2 sites training on the one GPU
# with top-k compressed on the device, beside the same federation on the CPU
# (same seed, data and rounds); their last test accuracies side by side.
federation_step() {
  local device port dir status=0
  local -a pids=() aggregators=()
  for device in cuda cpu; do
    [[ $device == cuda ]] && port=7610 || port=7710
    dir=$LOG_DIR/federation-$device
    rm -rf "$dir"
    bash "$ROOT/deploy/local_federation.sh" --fedmesh "$WRAPPED/fedmesh" --dir "$dir" --sites 2 --port "$port" \
      --metrics-port $((port + 50)) --rounds 6 --local-steps 40 --model mlp --partition iid \
      --agg "validation = \"$DATA\"" --agg "validation_limit = 1024" \
      --site "data.source = \"$DATA\"" --site "training.device = \"$device\"" \
      --site "compression.device = \"$device\"" --site 'compression.default = "topk:0.05"' > /dev/null || return 1
    ( timeout 120 "$WRAPPED/fedmesh" aggregator --config "$dir/agg.toml" > "$dir/aggregator.log" 2>&1 ) &
    aggregators+=($!)
    local k
    for k in 0 1; do
      ( timeout 120 "$WRAPPED/fedmesh" node --config "$dir/site-$k.toml" > "$dir/site-$k.log" 2>&1 ) &
      pids+=($!)
    done
  done
  # The sites end after their last round (or fail at once); an aggregator
  # left without sites is given 20 s to finish, then stopped.
  local pid waited
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  for pid in "${aggregators[@]}"; do
    for ((waited = 0; waited < 20; waited++)); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -0 "$pid" 2>/dev/null && kill_tree "$pid"
    wait "$pid" || status=1
  done
  for device in cuda cpu; do
    echo "== federation on $device"; grep -E "^round .* test accuracy|error|refused" "$LOG_DIR/federation-$device/aggregator.log" | tail -n 8
    grep -iE "error|fail" "$LOG_DIR"/federation-$device/site-*.log | tail -n 5 || true
  done
  python3 "$ROOT/deploy/gpu_kit_report.py" federation "$LOG_DIR" || status=1
  return $status
}

run_step() {
  local step=$1
  case $step in
    check) check_libraries ;;
    doctor)
      if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
      else
        echo "nvidia-smi: not on this machine"
      fi
      "$WRAPPED/fedmesh" doctor --json ;;
    smoke)
      "$WRAPPED/fedmesh" train --model gpt-nano --device cpu --steps 2 --batch-size 4 --test-limit 4 --threads 1 \
        --json ;;
    tests)
      # Exit 77: every test of the binary skipped (meson's convention; no GPU).
      local test code status=0 results=()
      for test in test_device test_cuda_ops test_compression_kernels_cuda test_device_training_cuda test_communicator_nccl; do
        echo "== $test"
        code=0
        timeout 120 "$WRAPPED/$test" --gtest_color=no || code=$?
        case $code in 0) results+=("$test: passed") ;; 77) results+=("$test: skipped") ;;
                      *) results+=("$test: FAILED (exit $code)"); status=1 ;; esac
      done
      printf '%s\n' "${results[@]}"
      return $status ;;
    sanitize) sanitize_step ;;
    train) train_step ;;
    kernels) kernels_step ;;
    batchscan)
      # Host- or device-bound: a step bound by the host's enqueueing costs about the
      # same at every batch size (tokens/s grow with the batch); one bound by the
      # device costs in proportion to it (tokens/s stay flat).
      local batch status=0
      for batch in 4 8 16 24; do
        echo "== batch $batch"
        timeout 60 "$WRAPPED/fedmesh" train --model gpt2 --device cuda --precision bf16 --batch-size "$batch" \
          --steps 24 --test-limit 1 --log-every 1000 --profile --json | grep '"event":"summary"' || status=1
      done
      return $status ;;
    federation) federation_step ;;
    throughput)
      # mlp and cnn on the GPU against PyTorch eager on the same GPU (fp32 and bf16).
      local precision status=0
      for precision in fp32 bf16; do
        echo "== throughput $precision"
        timeout 100 bash "$ROOT/bench/compare_torch.sh" --device cuda --precision "$precision" --models mlp,cnn \
          --batch-size 256 --steps 300 --threads 8 --no-compile --no-install --data-dir "$DATA" \
          --fedmesh "$WRAPPED/fedmesh" --out-dir "$LOG_DIR/throughput-$precision" || status=$?
      done
      return $status ;;
    profile)
      "$WRAPPED/fedmesh" train --model gpt2 --device cuda --precision bf16 --batch-size 16 --steps 20 \
        --test-limit 20 --log-every 5 --profile --json ;;
    gpt2)
      bash "$ROOT/bench/compare_torch_gpt.sh" --device cuda --precision bf16 --models gpt2 --batch-size 16 \
        --steps "$GPT2_STEPS" --test-limit 20 --same-init --fedmesh "$WRAPPED/fedmesh" --no-install --out-dir "$LOG_DIR/gpt2" ;;
  esac
}

# Stops PID and every process below it.
kill_tree() {
  local child
  for child in $(pgrep -P "$1" 2>/dev/null); do kill_tree "$child"; done
  kill -TERM "$1" 2>/dev/null || true
}

# run_step, stopped (with everything it started) at the --deadline if any.
run_with_deadline() {
  [[ $DEADLINE -gt 0 ]] || { run_step "$1"; return; }
  run_step "$1" &
  local pid=$!
  while kill -0 "$pid" 2>/dev/null && [[ $SECONDS -lt $DEADLINE ]]; do sleep 1; done
  if kill -0 "$pid" 2>/dev/null; then
    echo "gpu_kit: step $1 stopped at the --deadline of ${DEADLINE}s"
    kill_tree "$pid"
  fi
  wait "$pid"
}

run() {
  [[ -d $KIT/debs && -f $KIT/MANIFEST ]] || die "$KIT holds no kit: run deploy/gpu_kit.sh pack on a Debian 12 machine and copy the kit here"
  local -a steps summary=()
  local step
  local -a asked
  IFS=',' read -r -a asked <<< "$STEPS"
  steps=(check)
  for step in "${asked[@]}"; do
    [[ $step =~ ^(check|doctor|smoke|tests|sanitize|train|federation|throughput|profile|kernels|batchscan|gpt2)$ ]] ||
      die "unknown step '$step' (expected one of ${STEPS_DEFAULT//,/, })"
    [[ $step == check ]] || steps+=("$step")
  done
  mkdir -p "$LOG_DIR"
  PREFIX=$(mktemp -d "${TMPDIR:-/tmp}/fedmesh-gpu-kit.XXXXXX")
  trap 'rm -rf "$PREFIX"' EXIT
  unpack
  # The kit's binaries run through wrappers in PREFIX/kit-bin that set their
  # library path, so that PyTorch's python keeps the image's own libraries.
  LIBRARY_PATH_KIT=$(kit_library_path)
  WRAPPED=$PREFIX/kit-bin
  mkdir -p "$WRAPPED"
  local real
  for real in "$KIT"/bin/*; do
    printf '#!/bin/sh\nLD_LIBRARY_PATH=%q${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec %q "$@"\n' \
      "$LIBRARY_PATH_KIT" "$real" > "$WRAPPED/$(basename "$real")"
  done
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%q exec %q -p %q "$@"\n' "$LIBRARY_PATH_KIT" \
    "$PREFIX/usr/bin/bible" "$PREFIX/usr/lib" > "$WRAPPED/bible"
  chmod +x "$WRAPPED"/*
  DATA=$KIT/data/fashion-mnist
  export FEDMESH_BIBLE=$WRAPPED/bible FEDMESH_TEST_FASHION_MNIST_DIR=$DATA

  local status failed=0 start
  for step in "${steps[@]}"; do
    if [[ $DEADLINE -gt 0 && $SECONDS -ge $((DEADLINE - 20)) ]]; then
      summary+=("$(printf '%-10s not run: too close to the --deadline of %ss' "$step" "$DEADLINE")")
      failed=1
      continue
    fi
    say "step $step (log: $LOG_DIR/$step.log)"
    start=$SECONDS
    set +e
    if [[ $QUIET == 1 ]]; then
      run_with_deadline "$step" > "$LOG_DIR/$step.log" 2>&1
      status=$?
      # The step's verdict lines, or its end when it failed.
      grep -E "^(RESULT|test_[a-z_]+: |\[  FAILED  \]|federation on|GPU - CPU|[a-z-]+ +(fp32|bf16|fp16) )|ERROR|MISSED|error" \
        "$LOG_DIR/$step.log" | head -n 60 || true
      [[ $status -eq 0 ]] || tail -n 25 "$LOG_DIR/$step.log"
    else
      run_with_deadline "$step" > >(tee "$LOG_DIR/$step.log") 2>&1
      status=$?
    fi
    set -e
    summary+=("$(printf '%-10s exit %-3s %4ss' "$step" "$status" $((SECONDS - start)))")
    if [[ $status -ne 0 ]]; then
      failed=1
      [[ $step == check ]] && break   # nothing runs without its libraries
    fi
  done
  sleep 0.2   # let tee flush
  printf '%s\n' "--- gpu_kit steps (logs in $LOG_DIR)" "${summary[@]}" | tee "$LOG_DIR/summary.txt"
  python3 "$ROOT/deploy/gpu_kit_report.py" report "$LOG_DIR" || true
  if [[ -n $BUNDLE ]]; then
    tar -czf "$BUNDLE" --exclude='*.db' --exclude='*.db-*' -C "$LOG_DIR" . && say "logs bundled in $BUNDLE ($(du -h "$BUNDLE" | cut -f1))"
  fi
  return $failed
}

main() {
  [[ $# -gt 0 ]] || { usage >&2; exit 2; }
  local command=$1; shift
  local build=${FEDMESH_BUILD_DIR:-build}
  STEPS=$STEPS_DEFAULT LOG_DIR=${OUT:-} GPT2_STEPS=50 BUNDLE= QUIET=0 DEADLINE=0 SANITIZE_FILTER=.
  case $command in -h|--help) usage; return 0 ;; pack|run) ;; *) usage >&2; die "unknown command '$command'" ;; esac
  while [[ $# -gt 0 ]]; do
    case $1 in
      --build) [[ $# -ge 2 ]] || die "--build needs a directory"; build=$2; shift 2 ;;
      --kit) [[ $# -ge 2 ]] || die "--kit needs a directory"; KIT=$(readlink -f -- "$2"); shift 2 ;;
      --steps) [[ $# -ge 2 ]] || die "--steps needs a list"; STEPS=$2; shift 2 ;;
      --log-dir) [[ $# -ge 2 ]] || die "--log-dir needs a directory"; LOG_DIR=$2; shift 2 ;;
      --quiet) QUIET=1; shift ;;
      --sanitize-filter) [[ $# -ge 2 ]] || die "--sanitize-filter needs a regular expression"; SANITIZE_FILTER=$2; shift 2 ;;
      --deadline) [[ $# -ge 2 && $2 =~ ^[0-9]+$ ]] || die "--deadline needs seconds"; DEADLINE=$2; shift 2 ;;
      --bundle) [[ $# -ge 2 ]] || die "--bundle needs a file"; BUNDLE=$(readlink -f -- "$2"); shift 2 ;;
      --gpt2-steps) [[ $# -ge 2 && $2 =~ ^[0-9]+$ && $2 -ge 2 ]] || die "--gpt2-steps needs an integer >= 2"
                    GPT2_STEPS=$2; shift 2 ;;
      -h|--help) usage; return 0 ;;
      *) die "unknown argument '$1' (see --help)" ;;
    esac
  done
  [[ $build = /* ]] || build=$ROOT/$build
  LOG_DIR=${LOG_DIR:-$KIT/logs}
  case $command in
    pack) pack "$build" ;;
    run) run ;;
  esac
}

main "$@"
