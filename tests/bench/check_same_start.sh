#!/usr/bin/env bash
# PyTorch cross-check of `fedmesh train --init` and of bench/torch_gpt.py's
# copy of fedmesh's shuffle: gpt-nano trained 20 steps by both from PyTorch's
# initial weights in fedmesh's batch order (bench/compare_torch_gpt.sh
# --same-init) must reach the same held-out loss within fp32 rounding.
# Then the same weights saved in Hugging Face's GPT-2 layout (Conv1D
# transposed, mask buffers, tied lm_head) and read with --init-format
# hf-gpt2 must give fedmesh the same held-out loss to the last bit as in
# fedmesh's own layout.
# Skips (77) where no python has torch (Debian's python3-torch is not part of
# the suite's install).
set -euo pipefail
build=${1:?usage: check_same_start.sh BUILD_DIR}
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
python=""
for candidate in /usr/bin/python3 python3; do
  if "$candidate" -c 'import torch, numpy' 2>/dev/null; then python=$candidate; break; fi
done
if [[ -z $python ]]; then echo "SKIP: no python with torch and numpy (apt-get install python3-torch)"; exit 77; fi
if ! command -v bible >/dev/null && [[ -z ${FEDMESH_BIBLE:-} ]]; then echo "SKIP: no bible-kjv"; exit 77; fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
bash "$root/bench/compare_torch_gpt.sh" --models gpt-nano --steps 20 --batch-size 8 --test-limit 20 --threads 2 \
  --same-init --no-install --python "$python" --fedmesh "$build/cli/fedmesh" --out-dir "$out/runs" > "$out/report" 2>&1 \
  || { cat "$out/report"; exit 1; }
grep "same start" "$out/report"
"$python" - "$out/report" <<'PY'
import json, sys
records = [json.loads(l) for l in open(sys.argv[1]) if l.startswith('{"benchmark"')]
assert len(records) == 1, records
r = records[0]
assert r["same_init"], r
d = r["test_loss_difference"]
print(f"held-out loss fedmesh {r['fedmesh_test_loss']:.7f}, PyTorch {r['pytorch_test_loss']:.7f}, difference {d:.2e}")
# fp32 on both sides: the two differ by summation orders only.
if not abs(d) < 1e-4:
    sys.exit(f"FAIL: the losses differ by {d} (more than fp32 rounding)")
train = abs(r["fedmesh_train_loss"] - r["pytorch_train_loss"])
if not train < 1e-4:
    sys.exit(f"FAIL: the last training batch's losses differ by {train}")
print("OK: the same start gives the same losses")
PY

for layout in fedmesh hf-gpt2; do
  "$python" "$root/bench/torch_gpt.py" --model gpt-nano --seed 3 --write-init "$out/$layout.safetensors" \
    --init-layout "$layout" 2>/dev/null
done
# SGD at lr 1e-30 moves no fp32 weight: the summary's held-out loss is the initial weights'.
loss_of() {
  "$build/cli/fedmesh" train --model gpt-nano --steps 1 --optimizer sgd --lr 1e-30 --momentum 0 --weight-decay 0 \
    --batch-size 4 --test-limit 8 --threads 2 --json --init "$out/$1.safetensors" --init-format "$1" \
    | grep '"event":"summary"' | grep -o '"test_loss":[-0-9.e]*'
}
fedmesh_layout=$(loss_of fedmesh)
hf_layout=$(loss_of hf-gpt2)
echo "fedmesh layout: $fedmesh_layout; Hugging Face GPT-2 layout: $hf_layout"
[[ -n $fedmesh_layout && $fedmesh_layout == "$hf_layout" ]] || { echo "FAIL: the two layouts differ"; exit 1; }
refused=$("$build/cli/fedmesh" train --model gpt-nano --steps 1 --init "$out/hf-gpt2.safetensors" 2>&1) && {
  echo "FAIL: a Hugging Face file read in fedmesh's names was accepted"; exit 1; }
grep -q -- "--init-format hf-gpt2" <<< "$refused" || { echo "FAIL: no hint in: $refused"; exit 1; }
echo "OK: hf-gpt2 import equals fedmesh's layout; the wrong format is refused with a hint"

# Weights out: a trained run exported in Hugging Face's layout; PyTorch loads
# it (torch_gpt.py --init, at an lr too small to move a weight) and finds the
# held-out loss fedmesh finds for the same file, within fp32 summation order.
"$build/cli/fedmesh" train --model gpt-nano --steps 6 --batch-size 4 --test-limit 8 --threads 2 \
  --db "$out/trained.db" > /dev/null 2>&1
"$build/cli/fedmesh" checkpoint export "$out/trained.db" --format hf-gpt2 --out "$out/trained-hf.safetensors" > /dev/null
cp "$out/trained-hf.safetensors" "$out/hf-gpt2.safetensors"
fedmesh_loss=$(loss_of hf-gpt2 | cut -d: -f2)
torch_loss=$("$python" "$root/bench/torch_gpt.py" --model gpt-nano --steps 2 --batch-size 4 --test-limit 8 --threads 2 \
  --lr 1e-30 --weight-decay 0 --init "$out/trained-hf.safetensors" 2>/dev/null | "$python" -c 'import json,sys; print(json.loads(sys.stdin.read())["test_loss"])')
echo "exported in Hugging Face's layout: held-out loss fedmesh $fedmesh_loss, PyTorch $torch_loss"
"$python" -c "import sys; a, b = float('$fedmesh_loss'), float('$torch_loss'); sys.exit(0 if abs(a - b) <= 1e-5 * abs(b) else 1)" \
  || { echo "FAIL: PyTorch reads the export differently"; exit 1; }
echo "OK: PyTorch reads fedmesh's hf-gpt2 export to the same loss"
