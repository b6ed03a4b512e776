#!/usr/bin/env bash
# fedmesh: a kit for a GPU machine that has none of our Debian libraries.
#
# The lent GPU machines (the device tool) have nvcc, cuBLAS, NCCL and a CUDA
# PyTorch, but no package registry and none of the Debian libraries fedmesh
# links (ZeroMQ, libsodium, Cap'n Proto, SQLite, OpenBLAS, Gloo, ...). This
# script packs, here, everything the CUDA tests and the GPU benchmarks need
# into one git-ignored folder that travels with a device call (`carry`), and
# runs them there from it:
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
# What one device call may carry, the working tree included (device README).
CARRY_LIMIT_BYTES=$((64 << 20))
STEPS_DEFAULT=check,doctor,smoke,tests,profile,gpt2

usage() {
  cat <<EOF
Usage: deploy/gpu_kit.sh pack [--build DIR] [--kit DIR]
       deploy/gpu_kit.sh run  [--kit DIR] [--steps LIST] [--log-dir DIR] [--gpt2-steps N]

pack   On Debian 12, after a CUDA-enabled build (deploy/setup.sh where nvcc is
       found): copies and strips ${BINARIES[*]}
       into KIT/bin, downloads (apt-get download: the installed versions, or
       the mirror's current one where it no longer has them) the Debian
       packages of every shared library they load other than the C/C++
       runtime and CUDA's own, plus ${EXTRA_PACKAGES[*]}, into KIT/debs, cuts
       the first $FASHION_IMAGES images of each Fashion-MNIST split into
       KIT/data/fashion-mnist, and writes KIT/MANIFEST. Fails if the kit and the
       working tree would not fit one device call (64 MiB).
run    On the GPU machine, from the repository root: dpkg -x every package into
       a private prefix (a temporary folder, removed at the end; never /), then
       runs the steps in LIST (default $STEPS_DEFAULT):
         check    every binary's libraries resolve (the prefix, CUDA's lib64, the
                  image's own C/C++ runtime); always runs first
         doctor   fedmesh doctor --json (what the build and the machine have)
         smoke    fedmesh train --model gpt-nano --steps 2 on the CPU: the kit's
                  bible program (FEDMESH_BIBLE) gives the corpus
         tests    the CUDA test binaries (they skip without a GPU)
         profile  fedmesh train --model gpt2 --device cuda --precision bf16
                  --batch-size 16 --steps 20 --profile --json
         gpt2     bench/compare_torch_gpt.sh --device cuda --precision bf16
                  --models gpt2 --batch-size 16 --steps N --test-limit 20
                  (fedmesh vs PyTorch eager and torch.compile, MFU)
       Each step's output goes to LOG_DIR/STEP.log; the last lines are a table
       of the steps and their exit codes. Exit status: nonzero if any failed.
       A device call runs at most 10 minutes: give profile and gpt2 a call
       each rather than all the steps in one.

Options:
  --build DIR       build directory (default: \$FEDMESH_BUILD_DIR or build)
  --kit DIR         kit directory (default: .deps/gpu-kit, git-ignored)
  --steps LIST      comma-separated steps of run
  --log-dir DIR     where run writes its logs (default: \$OUT when set, else KIT/logs)
  --gpt2-steps N    optimizer steps of the gpt2 comparison (default: 50)
  -h, --help        show this help

A device call, for example (carry names the kit):
  run(command: "deploy/gpu_kit.sh run --log-dir \$OUT", carry: [".deps/gpu-kit"])
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
    strip --strip-unneeded -o "$KIT/bin/$name" "$build/$binary"
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

run_step() {
  local step=$1
  case $step in
    check) check_libraries ;;
    doctor) "$WRAPPED/fedmesh" doctor --json ;;
    smoke)
      "$WRAPPED/fedmesh" train --model gpt-nano --device cpu --steps 2 --batch-size 4 --test-limit 4 --threads 1 \
        --json ;;
    tests)
      # Exit 77: every test of the binary skipped (meson's convention; no GPU).
      local test code status=0 results=()
      for test in test_device test_cuda_ops test_compression_kernels_cuda test_device_training_cuda test_communicator_nccl; do
        echo "== $test"
        code=0
        timeout 300 "$WRAPPED/$test" --gtest_color=no || code=$?
        case $code in 0) results+=("$test: passed") ;; 77) results+=("$test: skipped") ;;
                      *) results+=("$test: FAILED (exit $code)"); status=1 ;; esac
      done
      printf '%s\n' "${results[@]}"
      return $status ;;
    profile)
      "$WRAPPED/fedmesh" train --model gpt2 --device cuda --precision bf16 --batch-size 16 --steps 20 \
        --test-limit 20 --log-every 5 --profile --json ;;
    gpt2)
      bash "$ROOT/bench/compare_torch_gpt.sh" --device cuda --precision bf16 --models gpt2 --batch-size 16 \
        --steps "$GPT2_STEPS" --test-limit 20 --fedmesh "$WRAPPED/fedmesh" --no-install --out-dir "$LOG_DIR/gpt2" ;;
  esac
}

run() {
  [[ -d $KIT/debs && -f $KIT/MANIFEST ]] || die "$KIT holds no kit: run deploy/gpu_kit.sh pack here first and carry it"
  local -a steps summary=()
  local step
  local -a asked
  IFS=',' read -r -a asked <<< "$STEPS"
  steps=(check)
  for step in "${asked[@]}"; do
    [[ $step =~ ^(check|doctor|smoke|tests|profile|gpt2)$ ]] ||
      die "unknown step '$step' (expected check, doctor, smoke, tests, profile or gpt2)"
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
  export FEDMESH_BIBLE=$WRAPPED/bible FEDMESH_TEST_FASHION_MNIST_DIR=$KIT/data/fashion-mnist

  local status failed=0 start
  for step in "${steps[@]}"; do
    say "step $step (log: $LOG_DIR/$step.log)"
    start=$SECONDS
    set +e
    run_step "$step" > >(tee "$LOG_DIR/$step.log") 2>&1
    status=$?
    set -e
    summary+=("$(printf '%-8s exit %-3s %4ss' "$step" "$status" $((SECONDS - start)))")
    if [[ $status -ne 0 ]]; then
      failed=1
      [[ $step == check ]] && break   # nothing runs without its libraries
    fi
  done
  sleep 0.2   # let tee flush
  printf '%s\n' "--- gpu_kit steps (logs in $LOG_DIR)" "${summary[@]}"
  return $failed
}

main() {
  [[ $# -gt 0 ]] || { usage >&2; exit 2; }
  local command=$1; shift
  local build=${FEDMESH_BUILD_DIR:-build}
  STEPS=$STEPS_DEFAULT LOG_DIR=${OUT:-} GPT2_STEPS=50
  case $command in -h|--help) usage; return 0 ;; pack|run) ;; *) usage >&2; die "unknown command '$command'" ;; esac
  while [[ $# -gt 0 ]]; do
    case $1 in
      --build) [[ $# -ge 2 ]] || die "--build needs a directory"; build=$2; shift 2 ;;
      --kit) [[ $# -ge 2 ]] || die "--kit needs a directory"; KIT=$(readlink -f -- "$2"); shift 2 ;;
      --steps) [[ $# -ge 2 ]] || die "--steps needs a list"; STEPS=$2; shift 2 ;;
      --log-dir) [[ $# -ge 2 ]] || die "--log-dir needs a directory"; LOG_DIR=$2; shift 2 ;;
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
