#!/usr/bin/env bash
# fedmesh quick start: set up and build, then train the CNN on Fashion-MNIST.
set -euo pipefail

DEPLOY=$(cd -- "$(dirname -- "$(readlink -f -- "${BASH_SOURCE[0]}")")" && pwd -P)

# Options the demo adds unless the user gives the same option: "--flag value"
# pairs. Edit here to change what the demo does by default.
DEFAULTS=(
  --model cnn
  --epochs 5
)

usage() {
  cat <<EOF
Usage: deploy/demo.sh [FEDMESH TRAIN OPTIONS...]

Runs deploy/setup.sh (installs missing packages, builds; its progress goes to
stderr), then trains on Fashion-MNIST:

  BUILD/cli/fedmesh train ${DEFAULTS[*]} [FEDMESH TRAIN OPTIONS...]

Every argument goes to "fedmesh train". A default option you give yourself
replaces the demo's, e.g.
  deploy/demo.sh --epochs 1 --json --seed 7

BUILD is FEDMESH_BUILD_DIR (default build/ at the repository root); see
deploy/setup.sh --help for the other environment variables. The options of
"fedmesh train" are listed by: BUILD/cli/fedmesh train --help
EOF
}

# True when the user's arguments already carry option $1 ("--x v" or "--x=v").
user_gave() {
  local opt=$1 arg
  shift
  for arg in "$@"; do
    if [[ $arg == "$opt" || $arg == "$opt="* ]]; then return 0; fi
  done
  return 1
}

main() {
  if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    usage
    return 0
  fi

  # Setup messages on stderr keep stdout for fedmesh (e.g. --json output).
  bash "$DEPLOY/setup.sh" >&2 || {
    printf 'fedmesh demo: error: setup failed\n' >&2
    return 1
  }
  local dir bin
  dir=$(bash "$DEPLOY/setup.sh" --print-build-dir)
  bin=$dir/cli/fedmesh
  [[ -x $bin ]] || {
    printf 'fedmesh demo: error: %s was not built (kernels_only build?)\n' "$bin" >&2
    return 1
  }

  local -a cmd=("$bin" train)
  local i
  for ((i = 0; i < ${#DEFAULTS[@]}; i += 2)); do
    if ! user_gave "${DEFAULTS[i]}" "$@"; then
      cmd+=("${DEFAULTS[i]}" "${DEFAULTS[i + 1]}")
    fi
  done
  cmd+=("$@")
  printf 'fedmesh demo: running:' >&2
  printf ' %q' "${cmd[@]}" >&2
  printf '\n' >&2
  exec "${cmd[@]}"
}

main "$@"
