#!/usr/bin/env bash
# Runs one libFuzzer target for a bounded time: FEDMESH_FUZZ_SECONDS (default
# 30), with the committed corpus as read-only seeds and a temporary directory
# for what it finds. Memory is capped (-rss_limit_mb, -malloc_limit_mb), so an
# unbounded allocation is a finding like a crash. A crash leaves its
# reproducer in FEDMESH_FUZZ_ARTIFACTS (default: the temporary directory,
# printed) and fails the test.
set -euo pipefail
if [[ $# -ne 2 ]]; then
  echo "usage: run_fuzz.sh FUZZ_TARGET SEED_CORPUS_DIR" >&2
  exit 2
fi
target=$1 seeds=$2
seconds=${FEDMESH_FUZZ_SECONDS:-30}
work=$(mktemp -d "${TMPDIR:-/tmp}/fedmesh-fuzz.XXXXXX")
artifacts=${FEDMESH_FUZZ_ARTIFACTS:-$work}
mkdir -p "$work/corpus" "$artifacts"
status=0
# -error_exitcode=1: libFuzzer's default, 77, is meson's code for a skipped
# test, and hid a crash as a skip.
"$target" "$work/corpus" "$seeds" \
  -max_total_time="$seconds" -rss_limit_mb=2048 -malloc_limit_mb=512 -timeout=20 -error_exitcode=1 \
  -print_final_stats=1 -artifact_prefix="$artifacts/" || status=$?
if [[ $status -ne 0 ]]; then
  echo "run_fuzz: $(basename "$target") FAILED (exit $status); reproducers in $artifacts" >&2
  exit 1  # never 77, which meson would count as a skip
fi
rm -rf "$work"
