#!/usr/bin/env bash
# deploy/gpu_kit.sh end to end on this machine: pack a kit from the CUDA
# build into a temporary folder (apt-get download needs Debian's mirror, as
# deploy/setup.sh does), then run it as a GPU machine would: the packages
# unpack into the kit's prefix, every binary's libraries resolve from there
# (or from the C/C++ runtime and CUDA), the CUDA tests run (and skip here,
# saying why, without a GPU), and a language model reads the King James
# Bible through the kit's own bible program.
# Usage: tests/deploy/check_gpu_kit.sh BUILD_DIR
set -euo pipefail
ROOT=$(cd -- "$(dirname -- "$0")/../.." && pwd -P)
BUILD=${1:?usage: check_gpu_kit.sh BUILD_DIR}
fail() { printf 'check_gpu_kit: %s\n' "$*" >&2; exit 1; }
KIT=$(mktemp -d); trap 'rm -rf "$KIT"' EXIT

bash "$ROOT/deploy/gpu_kit.sh" pack --build "$BUILD" --kit "$KIT" || fail "pack failed"
for name in fedmesh test_cuda_ops test_device_training_cuda; do
  [[ -x $KIT/bin/$name ]] || fail "the kit lacks $name"
done
ls "$KIT"/debs/bible-kjv_*.deb "$KIT"/debs/libzmq5_*.deb >/dev/null || fail "the kit lacks bible-kjv or libzmq5"
grep -q "^packages:" "$KIT/MANIFEST" || fail "no MANIFEST"

status=0
bash "$ROOT/deploy/gpu_kit.sh" run --kit "$KIT" --steps check,smoke,tests --log-dir "$KIT/logs" || status=$?
[[ $status -eq 0 ]] || fail "run exited $status: $(tail -n 20 "$KIT"/logs/*.log)"
grep -q "resolves" "$KIT/logs/check.log" || fail "check did not say the libraries resolve"
grep -q '"event":"summary"' "$KIT/logs/smoke.log" || fail "the smoke run printed no summary: $(tail -n 5 "$KIT/logs/smoke.log")"
grep -q "and bible resolves" "$KIT/logs/check.log" || fail "the kit's bible program was not checked"
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi >/dev/null 2>&1; then
  grep -q "SKIPPED" "$KIT/logs/tests.log" || fail "without a GPU the CUDA tests should skip"
fi
echo "ok: a kit packed from $BUILD runs its checks, a language model on its own bible, and the CUDA tests"
