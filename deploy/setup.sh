#!/usr/bin/env bash
# fedmesh: install the missing Debian packages, then configure and build.
set -euo pipefail

# Debian 12 packages the build, the tests and the demo need. Keep this the one
# list: add new dependencies here.
PACKAGES=(
  build-essential pkg-config meson ninja-build python3
  libzmq3-dev cppzmq-dev libsodium-dev
  capnproto libcapnp-dev
  libsqlite3-dev libopenblas-dev libgloo-dev zlib1g-dev libpng-dev libjpeg62-turbo-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev libtomlplusplus-dev libfmt-dev libspdlog-dev
  nlohmann-json3-dev libcpp-httplib-dev
  clang libclang-rt-dev
  python3-numpy python3-yaml python3-sklearn python3-torch python3-regex systemd iproute2
  chromium
  dataset-fashion-mnist bible-kjv
)

# Meson options of the --sanitize build (FEDMESH_MESON_ARGS come after them).
SANITIZE_ARGS=('-Db_sanitize=address,undefined' -Db_lundef=false -Dbuildtype=debugoptimized)
# The --fuzz build: clang, CPU only, and only the libFuzzer targets built:
# every entry of fuzz_targets in tests/fuzz/meson.build (read from there by
# fuzz_targets below, so a new target needs no line here).
FUZZ_ARGS=(-Dcuda=disabled -Dbenchmarks=false -Dfuzz=enabled)
# The --tsan build: ThreadSanitizer (gcc's), CPU only, and only what the
# tests of the `tsan` suite in tests/meson.build run (read from the
# configured directory by suite_targets below, so a test labelled `tsan`
# needs no line here). -O1 and line tables only (-g1): TSan's reports keep
# their function names and lines, and the build takes about 40% less time
# than at -O2 -g.
TSAN_ARGS=(-Dcuda=disabled -Dbenchmarks=false -Dfuzz=disabled -Db_sanitize=thread
           -Doptimization=1 -Ddebug=false -Dcpp_args=-g1)

CUDA_BIN=/usr/local/cuda/bin
# Written into the build directory: the meson arguments it was configured with.
STAMP_NAME=.fedmesh-setup-args

ROOT=$(cd -- "$(dirname -- "$(readlink -f -- "${BASH_SOURCE[0]}")")/.." && pwd -P)

usage() {
  cat <<EOF
Usage: deploy/setup.sh [--sanitize | --fuzz | --tsan] [--dry-run] [--print-build-dir] [--help]

Installs the Debian packages fedmesh needs (only those missing; as root, or
through sudo), then configures the build with meson and builds it with ninja.
Runs from any directory; does nothing slow when all is present and built.

Options:
  --sanitize         build with AddressSanitizer + UBSan in the build directory
                     with "-sanitize" appended (default build-sanitize/), using
                     ${SANITIZE_ARGS[*]}
  --fuzz             build only the libFuzzer targets (tests/fuzz) with clang
                     in the build directory with "-fuzz" appended (default
                     build-fuzz/), using ${FUZZ_ARGS[*]}
  --tsan             build only the tests of the \`tsan\` suite (and what they
                     run) with ThreadSanitizer in the build directory with
                     "-tsan" appended (default build-tsan/), using
                     ${TSAN_ARGS[*]}
  --dry-run          print what would be installed and run, change nothing
  --print-build-dir  print the absolute build directory (honours --sanitize,
                     --fuzz, --tsan and FEDMESH_BUILD_DIR) and exit
  -h, --help         show this help

Environment:
  FEDMESH_BUILD_DIR     build directory, relative to the repository root or
                        absolute (default: build)
  FEDMESH_MESON_ARGS    extra meson setup arguments, separated by whitespace,
                        e.g. "-Dcuda=disabled -Dbenchmarks=false"
  FEDMESH_SKIP_INSTALL  set to 1 to skip the package step (non-Debian systems,
                        machines without network access)
  FEDMESH_JOBS          parallel build jobs for ninja (default: ninja's own)

If ${CUDA_BIN}/nvcc exists it is put on PATH so that meson (cuda=auto)
builds the CUDA backend. The build directory is configured once; when the
meson arguments (or the presence of nvcc) change, it is configured afresh.
EOF
}

say() { printf 'fedmesh setup: %s\n' "$*"; }
die() { printf 'fedmesh setup: error: %s\n' "$*" >&2; exit 1; }

# Prints the absolute build directory for the given sanitize flag (0/1).
build_dir() {
  local dir=${FEDMESH_BUILD_DIR:-build}
  [[ -n $dir ]] || dir=build
  dir=${dir%/}
  if [[ $1 == 1 ]]; then dir=${dir}-sanitize; fi
  if [[ $1 == fuzz ]]; then dir=${dir}-fuzz; fi
  if [[ $1 == tsan ]]; then dir=${dir}-tsan; fi
  if [[ $dir != /* ]]; then dir=$ROOT/$dir; fi
  printf '%s\n' "$dir"
}

# Prints, one per line, the given packages that dpkg does not list as installed.
missing_packages() {
  local pkg status
  for pkg in "$@"; do
    status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)
    # "install ok installed" (or "hold ok installed"); a Multi-Arch: same
    # package installed for two architectures prints its status twice.
    if [[ $status != *"ok installed"* ]]; then
      printf '%s\n' "$pkg"
    fi
  done
}

# Prints, one per line, the ninja targets that the tests of meson suite $2
# in the configured build directory $1 need: each test's executable and
# its depends (e.g. the fedmesh binary that an integration test starts).
suite_targets() {
  meson introspect "$1" --tests --targets | python3 -c '
import json, os, sys
build, suite = sys.argv[1], sys.argv[2]
data = json.load(sys.stdin)
by_id = {t["id"]: t for t in data["targets"]}
by_file = {f: t for t in data["targets"] for f in t["filename"]}
out = set()
for test in data["tests"]:
    if suite not in [s.split(":")[-1] for s in test["suite"]]:
        continue
    wanted = [by_id[d] for d in test["depends"] if d in by_id]
    if test["cmd"] and test["cmd"][0] in by_file:
        wanted.append(by_file[test["cmd"][0]])
    for target in wanted:
        out.update(os.path.relpath(f, build) for f in target["filename"])
print("\n".join(sorted(out)))
' "$1" "$2"
}

# Shows a command (shell-quoted) in dry-run mode, runs it otherwise.
run() {
  if [[ $DRY_RUN == 1 ]]; then
    printf 'fedmesh setup: would run:'
    printf ' %q' "$@"
    printf '\n'
  else
    "$@"
  fi
}

install_packages() {
  if [[ ${FEDMESH_SKIP_INSTALL:-0} == 1 ]]; then
    say "skipping the package step (FEDMESH_SKIP_INSTALL=1)"
    return
  fi
  if ! command -v dpkg-query >/dev/null 2>&1; then
    die "dpkg-query not found: this script installs packages on Debian only." \
        "Install the equivalents of: ${PACKAGES[*]}; then rerun with FEDMESH_SKIP_INSTALL=1"
  fi
  local -a missing
  mapfile -t missing < <(missing_packages "${PACKAGES[@]}")
  if [[ ${#missing[@]} -eq 0 ]]; then
    say "all ${#PACKAGES[@]} packages present"
    return
  fi
  if [[ $EUID -ne 0 ]] && ! command -v sudo >/dev/null 2>&1; then
    die "${#missing[@]} packages missing (${missing[*]}) and not root and no sudo:" \
        "run as root, or install them and rerun (FEDMESH_SKIP_INSTALL=1 skips this check)"
  fi
  say "installing ${#missing[@]} packages: ${missing[*]}"
  local -a as_root=()
  if [[ $EUID -ne 0 ]]; then as_root=(sudo); fi
  run "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q \
    || die "apt-get update failed"
  run "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -q --no-install-recommends "${missing[@]}" \
    || die "apt-get install failed for: ${missing[*]}"
  if [[ $DRY_RUN == 0 ]]; then
    mapfile -t missing < <(missing_packages "${missing[@]}")
    [[ ${#missing[@]} -eq 0 ]] || die "still not installed after apt-get: ${missing[*]}"
  fi
}

configure_and_build() {
  local dir=$1; shift
  local -a args=("$@")
  local shown=${dir#"$ROOT"/}/
  local cuda_line=no-nvcc
  if [[ -x $CUDA_BIN/nvcc ]]; then
    case ":$PATH:" in
      *":$CUDA_BIN:"*) ;;
      *) export PATH="$CUDA_BIN:$PATH" ;;
    esac
    cuda_line="nvcc=$CUDA_BIN/nvcc"
    say "found $CUDA_BIN/nvcc: on PATH for meson's CUDA detection (cuda=auto builds the GPU backend)"
  fi
  if [[ $DRY_RUN == 0 ]]; then
    command -v meson >/dev/null 2>&1 || die "meson not found (install the meson package)"
    command -v ninja >/dev/null 2>&1 || die "ninja not found (install the ninja-build package)"
  fi

  # What the directory is configured with: the arguments plus whether nvcc is
  # there (meson detects compilers only on a fresh setup).
  local want have=
  want=$(printf '%s\n' "$cuda_line" "${args[@]}")
  if [[ -f $dir/$STAMP_NAME ]]; then have=$(<"$dir/$STAMP_NAME"); fi

  if [[ ! -f $dir/meson-private/coredata.dat ]]; then
    say "configuring $shown: meson setup ${args[*]:-(default options)}"
    run meson setup "$dir" "${args[@]}" \
      || die "meson setup failed (log: $shown""meson-logs/meson-log.txt)"
  elif [[ ! -f $dir/$STAMP_NAME ]]; then
    # Configured by hand: keep its options, add ours if any.
    if [[ ${#args[@]} -gt 0 ]]; then
      say "reconfiguring $shown with: ${args[*]}"
      run meson setup --reconfigure "$dir" "${args[@]}" \
        || die "meson setup --reconfigure failed (log: $shown""meson-logs/meson-log.txt)"
    fi
  elif [[ $have != "$want" ]]; then
    # Options dropped from the arguments would survive a --reconfigure, so
    # start afresh in the directory this script configured before.
    say "meson arguments changed (were: $(paste -sd' ' <<<"$have"); now: $(paste -sd' ' <<<"$want")); configuring $shown afresh"
    run rm -rf -- "$dir"
    run meson setup "$dir" "${args[@]}" \
      || die "meson setup failed (log: $shown""meson-logs/meson-log.txt)"
  fi
  if [[ $DRY_RUN == 0 && $have != "$want" ]]; then
    printf '%s\n' "$want" >"$dir/$STAMP_NAME"
  fi

  if [[ -n ${SUITE_TARGETS:-} ]]; then
    if [[ $DRY_RUN == 1 ]]; then
      say "would build what the tests of the $SUITE_TARGETS suite need"
    else
      # build.ninja first: a meson.build changed since the last configure
      # regenerates the introspection data that suite_targets reads.
      ninja -C "$dir" build.ninja >/dev/null || die "could not regenerate $shown""build.ninja"
      mapfile -t NINJA_TARGETS < <(suite_targets "$dir" "$SUITE_TARGETS")
      ((${#NINJA_TARGETS[@]} > 0)) || die "found no tests of the $SUITE_TARGETS suite in $shown"
    fi
  fi
  say "building in $shown"
  local -a jobs=()
  if [[ -n ${FEDMESH_JOBS:-} ]]; then jobs=(-j "$FEDMESH_JOBS"); fi
  run ninja -C "$dir" "${jobs[@]}" "${NINJA_TARGETS[@]}" || die "build failed in $shown"
}

main() {
  local sanitize=0 print_dir=0
  DRY_RUN=0
  while [[ $# -gt 0 ]]; do
    case $1 in
      --sanitize) sanitize=1 ;;
      --fuzz) sanitize=fuzz ;;
      --tsan) sanitize=tsan ;;
      --dry-run) DRY_RUN=1 ;;
      --print-build-dir) print_dir=1 ;;
      -h|--help) usage; return 0 ;;
      *) printf 'fedmesh setup: unknown argument: %s (see --help)\n' "$1" >&2; return 2 ;;
    esac
    shift
  done

  local dir
  dir=$(build_dir "$sanitize")
  if [[ $print_dir == 1 ]]; then
    printf '%s\n' "$dir"
    return 0
  fi

  local -a args=() extra=()
  NINJA_TARGETS=()
  if [[ $sanitize == 1 ]]; then args+=("${SANITIZE_ARGS[@]}"); fi
  if [[ $sanitize == fuzz ]]; then
    args+=("${FUZZ_ARGS[@]}")
    mapfile -t NINJA_TARGETS < <(sed -n "s|^  \['\([a-z_]*\)',.*|tests/fuzz/fuzz_\1|p" "$ROOT/tests/fuzz/meson.build")
    ((${#NINJA_TARGETS[@]} > 0)) || die "found no fuzz targets in tests/fuzz/meson.build"
    export CC=clang CXX=clang++
  fi
  SUITE_TARGETS=
  if [[ $sanitize == tsan ]]; then
    args+=("${TSAN_ARGS[@]}")
    SUITE_TARGETS=tsan
  fi
  read -r -a extra <<<"${FEDMESH_MESON_ARGS:-}"
  args+=("${extra[@]}")

  cd -- "$ROOT"
  install_packages
  configure_and_build "$dir" "${args[@]}"
  if [[ $DRY_RUN == 1 ]]; then
    say "dry run: nothing was changed"
  else
    say "done: $dir"
  fi
}

# Sourcing the file (for tests) defines the functions without running main.
if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
  main "$@"
fi
