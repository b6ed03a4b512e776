#!/usr/bin/env bash
# fedmesh: set up and build, run the test suite, print a one-line summary.
set -euo pipefail

DEPLOY=$(cd -- "$(dirname -- "$(readlink -f -- "${BASH_SOURCE[0]}")")" && pwd -P)

usage() {
  cat <<'EOF'
Usage: deploy/test.sh [--sanitize] [--no-fuzz] [--no-tsan] [-- MESON TEST ARGS...]

Runs deploy/setup.sh (installs missing packages, configures, builds), then
  meson test -C BUILD --print-errorlogs --num-processes 2 [MESON TEST ARGS...]
then (unless --no-fuzz, --sanitize or MESON TEST ARGS are given) builds the
libFuzzer targets with clang (deploy/setup.sh --fuzz, in BUILD-fuzz/) and runs
  meson test -C BUILD-fuzz --suite fuzz --suite fuzz-run
which replays every committed corpus and fuzzes each target for
FEDMESH_FUZZ_SECONDS (default 30) seconds; then (unless --no-tsan, --sanitize
or MESON TEST ARGS are given) builds the tests of the `tsan` suite with
ThreadSanitizer (deploy/setup.sh --tsan, in BUILD-tsan/) and runs
  meson test -C BUILD-tsan --suite tsan
(the transport, HTTP endpoint, worker pool, peer link and data-parallel
tests, and two real federations, gossip and aggregator, while their HTTP
endpoints are asked again and again; tests/meson.build lists them). It
prints the wall time and, as its last line, counting every run,
  N passed, N failed, N skipped
(OK and EXPECTEDFAIL count as passed; FAIL, TIMEOUT, ERROR, UNEXPECTEDPASS and
INTERRUPT as failed). Exits nonzero when the build fails, a test fails, or no
test ran.

Options:
  --sanitize   build and test with AddressSanitizer + UBSan (build-sanitize/)
  --no-fuzz    skip the libFuzzer build and runs
  --no-tsan    skip the ThreadSanitizer build and runs
  -h, --help   show this help
  -- ARGS      the rest goes to meson test, e.g.
                 deploy/test.sh -- --suite kernels
                 deploy/test.sh -- tensor_test --num-processes 8

BUILD is FEDMESH_BUILD_DIR (default build/ at the repository root); see
deploy/setup.sh --help for the other environment variables.
EOF
}

# Reads meson testlog files (one JSON object per line) and prints
# "PASSED FAILED SKIPPED" on the first line, then the failed tests' names.
summarize() {
  python3 - "$@" <<'PY'
import json, sys

passed, failed, skipped, failed_names = 0, 0, 0, []
for path in sys.argv[1:]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"fedmesh test: error: {path}:{lineno}: bad JSON: {e}")
            result = entry.get("result")
            if result in ("OK", "EXPECTEDFAIL"):
                passed += 1
            elif result == "SKIP":
                skipped += 1
            else:  # FAIL, TIMEOUT, ERROR, UNEXPECTEDPASS, INTERRUPT, unknown
                failed += 1
                failed_names.append(f"{entry.get('name', '?')} ({result})")
print(passed, failed, skipped)
for name in failed_names:
    print(name)
PY
}

main() {
  local start=$EPOCHREALTIME
  local sanitize=0 fuzz=1 tsan=1
  local -a setup_args=() test_args=()
  while [[ $# -gt 0 ]]; do
    case $1 in
      --sanitize) sanitize=1 fuzz=0 tsan=0 setup_args+=(--sanitize) ;;
      --no-fuzz) fuzz=0 ;;
      --no-tsan) tsan=0 ;;
      -h|--help) usage; return 0 ;;
      --) shift; test_args=("$@"); fuzz=0 tsan=0; break ;;
      *) printf 'fedmesh test: unknown argument: %s (meson test arguments go after --; see --help)\n' "$1" >&2
         return 2 ;;
    esac
    shift
  done

  local dir
  dir=$(bash "$DEPLOY/setup.sh" --print-build-dir "${setup_args[@]}")

  local passed=0 failed=0 skipped=0 status=0 why=
  if ! bash "$DEPLOY/setup.sh" "${setup_args[@]}"; then
    status=1 why="build failed"
  else
    if [[ $sanitize == 1 ]]; then
      # ASan under the CUDA runtime needs protect_shadow_gap=0; the rest is
      # what meson test would set.
      export ASAN_OPTIONS=${ASAN_OPTIONS:-halt_on_error=1:abort_on_error=1:print_summary=1:protect_shadow_gap=0}
    fi
    # A stale log from an earlier run must not be counted.
    rm -f -- "$dir"/meson-logs/testlog*.json
    local meson_rc=0
    meson test -C "$dir" --print-errorlogs --num-processes 2 "${test_args[@]}" || meson_rc=$?

    local -a logs=()
    shopt -s nullglob
    logs=("$dir"/meson-logs/testlog*.json)
    shopt -u nullglob

    if [[ $fuzz == 1 ]]; then
      local fuzz_dir
      fuzz_dir=$(bash "$DEPLOY/setup.sh" --print-build-dir --fuzz)
      rm -f -- "$fuzz_dir"/meson-logs/testlog*.json
      if ! bash "$DEPLOY/setup.sh" --fuzz; then
        why="the libFuzzer build failed" status=1
      else
        meson test -C "$fuzz_dir" --no-rebuild --print-errorlogs --num-processes 2 \
          --suite fuzz --suite fuzz-run || meson_rc=$?
        shopt -s nullglob
        logs+=("$fuzz_dir"/meson-logs/testlog*.json)
        shopt -u nullglob
      fi
    fi
    if [[ $tsan == 1 ]]; then
      local tsan_dir tsan_start=$EPOCHREALTIME
      tsan_dir=$(bash "$DEPLOY/setup.sh" --print-build-dir --tsan)
      rm -f -- "$tsan_dir"/meson-logs/testlog*.json
      if ! bash "$DEPLOY/setup.sh" --tsan; then
        why="${why:+$why; }the ThreadSanitizer build failed" status=1
      else
        # TSAN_OPTIONS (the suppressions file) come from the build's default
        # test setup (tests/meson.build).
        meson test -C "$tsan_dir" --no-rebuild --print-errorlogs --num-processes 2 \
          --suite tsan || meson_rc=$?
        shopt -s nullglob
        logs+=("$tsan_dir"/meson-logs/testlog*.json)
        shopt -u nullglob
      fi
      local tsan_us=$(( ${EPOCHREALTIME//[!0-9]/} - ${tsan_start//[!0-9]/} ))
      printf 'fedmesh test: the ThreadSanitizer leg (build and run) took %d.%01d s\n' \
        $((tsan_us / 1000000)) $((tsan_us % 1000000 / 100000))
    fi
    local -a lines=()
    if [[ ${#logs[@]} -gt 0 ]]; then
      local out
      out=$(summarize "${logs[@]}") || { status=1 why="could not read ${logs[*]}"; }
      if [[ -n $out ]]; then mapfile -t lines <<<"$out"; fi
    fi
    if [[ ${#lines[@]} -gt 0 ]]; then
      read -r passed failed skipped <<<"${lines[0]}"
    fi
    if [[ ${#lines[@]} -gt 1 ]]; then
      printf 'fedmesh test: failed: %s\n' "${lines[@]:1}"
    fi
    if [[ -n $why ]]; then
      :
    elif ((passed + failed + skipped == 0)); then
      status=1 why="no tests ran (tests disabled with -Dtests=false, or no test matched the arguments?)"
    elif ((failed > 0)); then
      status=1 why="$failed test(s) failed"
    elif ((meson_rc != 0)); then
      status=1 why="meson test exited with status $meson_rc"
    fi
  fi

  if [[ -n $why ]]; then printf 'fedmesh test: error: %s\n' "$why"; fi
  # A broken build or an empty run must read as a failure on the last line too.
  if ((status != 0 && failed == 0)); then failed=1; fi
  local end=$EPOCHREALTIME
  # EPOCHREALTIME has 6 decimals; the separator follows the locale.
  local us=$(( ${end//[!0-9]/} - ${start//[!0-9]/} ))
  printf 'fedmesh test: wall time %d.%01d s\n' $((us / 1000000)) $((us % 1000000 / 100000))
  printf '%d passed, %d failed, %d skipped\n' "$passed" "$failed" "$skipped"
  return "$status"
}

main "$@"
