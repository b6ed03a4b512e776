#!/usr/bin/env bash
# Runs check_torch_round_trip.py with the first python that has PyTorch
# (bench/torch_python.sh); exits 77 (meson's skip) where none has it.
# usage: torch_round_trip.sh FEDMESH
set -euo pipefail
HERE=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)
# shellcheck source=../../bench/torch_python.sh
source "$HERE/../../bench/torch_python.sh"
PY=$(find_python) || { echo "SKIP: no python here imports torch and numpy (deploy/setup.sh installs python3-torch)"; exit 77; }
WORK=$(mktemp -d "${TMPDIR:-/tmp}/fedmesh-torch-round-trip.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
"$PY" "$HERE/check_torch_round_trip.py" "$1" "$WORK"
