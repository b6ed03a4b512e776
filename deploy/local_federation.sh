#!/usr/bin/env bash
# Writes a complete federation for one machine: an admin key, an aggregator
# and N sites with their own keys, a roster signed by the admin, and one
# config per process (agg.toml, site-K.toml). With --gossip there is no
# aggregator: the N sites are gossip peers (roster role peer) listening on
# PORT..PORT+N-1. Used by deploy/demo.sh and the
# integration tests; across real machines each institution runs
# `fedmesh keygen` itself and sends only its .pub to the admin
# (docs/deployment.md).
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: deploy/local_federation.sh --fedmesh BIN --dir DIR [--sites 4] [--port 7400] [--metrics-port 9400]
                                  [--rounds 15] [--local-steps 60] [--mode sync|fedbuff|fedasync]
                                  [--deadline 30] [--min-sites SITES] [--gossip]
                                  [--model mlp] [--partition dirichlet:0.5] [--tokenizer FILE]
                                  [--agg 'KEY = VALUE']... [--site 'KEY = VALUE']...

Creates DIR (it must not exist yet) holding keys/, roster.toml, agg.toml and
site-0.toml .. site-(N-1).toml, for an aggregator on tcp://127.0.0.1:PORT with
metrics on 127.0.0.1:METRICS_PORT (sites use METRICS_PORT+1+K). Each --agg or
--site adds one TOML line to agg.toml or to every site's config, e.g.
--agg 'validation_limit = 2000' --site 'data.train_limit = 6000'. A key given
twice is an error, so add only keys the script does not write itself:
  agg.toml     federation name listen keys roster admin_public store metrics
               model seed rounds local_steps min_sites rounds_mode
               deadline_seconds (and tokenizer with --tokenizer)
  site-K.toml  federation name aggregator (gossip: mode gossip.rounds
               gossip.local_steps) keys roster admin_public store metrics
               model seed data.partition data.sites data.index data.seed
               training.threads (and data.tokenizer with --tokenizer)
Every key is described in docs/configuration.md.

--model names the model of every process (mlp, cnn, or a language model:
gpt-nano, gpt-tiny, ...); --partition how the sites split the data
(dirichlet:A, iid, shards:K for images; iid, books, contiguous or testament for a
language model's text, the Bible by default); --tokenizer a BPE tokenizer
file (`fedmesh tokenizer train`) that the aggregator (`tokenizer`) and every
site (`data.tokenizer`) read a language model's text with instead of bytes,
written into the configs as an absolute path (with --gossip, every peer's).

--gossip: no aggregator and no agg.toml. Site K is a gossip peer listening on
tcp://127.0.0.1:PORT+K (metrics on METRICS_PORT+1+K); its config has
mode = "gossip", gossip.rounds = ROUNDS and gossip.local_steps = LOCAL_STEPS;
add other gossip.* and swim.* keys with --site, e.g.
--site 'gossip.topology = "ring"'.
EOF
}

FEDMESH="" DIR="" SITES=4 PORT=7400 METRICS_PORT=9400
AGG_EXTRA=() SITE_EXTRA=()
ROUNDS=15 LOCAL_STEPS=60 MODE=sync DEADLINE=30 MIN_SITES= GOSSIP=0 MODEL=mlp PARTITION=dirichlet:0.5 TOKENIZER=
while [[ $# -gt 0 ]]; do
  case $1 in
    --fedmesh) FEDMESH=$2; shift 2 ;;
    --dir) DIR=$2; shift 2 ;;
    --sites) SITES=$2; shift 2 ;;
    --port) PORT=$2; shift 2 ;;
    --metrics-port) METRICS_PORT=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --local-steps) LOCAL_STEPS=$2; shift 2 ;;
    --mode) MODE=$2; shift 2 ;;
    --deadline) DEADLINE=$2; shift 2 ;;
    --min-sites) MIN_SITES=$2; shift 2 ;;
    --gossip) GOSSIP=1; shift ;;
    --model) MODEL=$2; shift 2 ;;
    --partition) PARTITION=$2; shift 2 ;;
    --tokenizer) TOKENIZER=$2; shift 2 ;;
    --agg) AGG_EXTRA+=("$2"); shift 2 ;;
    --site) SITE_EXTRA+=("$2"); shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) printf 'local_federation.sh: unknown argument %s\n' "$1" >&2; usage >&2; exit 2 ;;
  esac
done
[[ -n $FEDMESH && -n $DIR ]] || { usage >&2; exit 2; }
[[ $SITES =~ ^[1-9][0-9]*$ ]] || { printf 'local_federation.sh: --sites must be a positive integer\n' >&2; exit 2; }
[[ -e $DIR ]] && { printf 'local_federation.sh: %s exists; give a new directory\n' "$DIR" >&2; exit 2; }
if [[ -n $TOKENIZER ]]; then
  [[ -f $TOKENIZER ]] || { printf 'local_federation.sh: --tokenizer %s is not a file\n' "$TOKENIZER" >&2; exit 2; }
  TOKENIZER=$(cd "$(dirname "$TOKENIZER")" && pwd -P)/$(basename "$TOKENIZER")
fi
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd -P)
FED=fed-local

"$FEDMESH" keygen --name admin --out "$DIR/keys" >/dev/null 2>&1
"$FEDMESH" roster init --federation "$FED" --admin-public "$DIR/keys/admin.pub" --out "$DIR/roster.toml" >/dev/null
if ((GOSSIP == 0)); then
  "$FEDMESH" keygen --name aggregator --out "$DIR/keys" >/dev/null 2>&1
  "$FEDMESH" roster add --roster "$DIR/roster.toml" --public "$DIR/keys/aggregator.pub" --role aggregator \
    --address "tcp://127.0.0.1:$PORT" >/dev/null
fi
for ((k = 0; k < SITES; k++)); do
  "$FEDMESH" keygen --name "site-$k" --out "$DIR/keys" >/dev/null 2>&1
  if ((GOSSIP)); then
    "$FEDMESH" roster add --roster "$DIR/roster.toml" --public "$DIR/keys/site-$k.pub" --role peer \
      --address "tcp://127.0.0.1:$((PORT + k))" >/dev/null
  else
    "$FEDMESH" roster add --roster "$DIR/roster.toml" --public "$DIR/keys/site-$k.pub" --role site >/dev/null
  fi
done
"$FEDMESH" roster sign --roster "$DIR/roster.toml" --admin-key "$DIR/keys/admin.key" >/dev/null
ADMIN=$(sed -n 's/^sign_public = "\([0-9a-f]*\)"$/\1/p' "$DIR/keys/admin.pub")

((GOSSIP)) || {
  cat <<EOF
# The aggregator of a local federation (deploy/local_federation.sh).
federation = "$FED"
name = "aggregator"
listen = "tcp://127.0.0.1:$PORT"
keys = "$DIR/keys/aggregator.key"
roster = "$DIR/roster.toml"
admin_public = "$ADMIN"
store = "$DIR/aggregator.db"
metrics = "127.0.0.1:$METRICS_PORT"
model = "$MODEL"
seed = 1
rounds = $ROUNDS
local_steps = $LOCAL_STEPS
min_sites = ${MIN_SITES:-$SITES}
rounds_mode = "$MODE"
deadline_seconds = $DEADLINE
EOF
  [[ -z $TOKENIZER ]] || printf 'tokenizer = "%s"\n' "$TOKENIZER"
  for line in "${AGG_EXTRA[@]}"; do printf '%s\n' "$line"; done
} > "$DIR/agg.toml"

for ((k = 0; k < SITES; k++)); do
  {
    cat <<EOF
# Site $k of a local federation (deploy/local_federation.sh).
federation = "$FED"
name = "site-$k"
$(if ((GOSSIP)); then
  printf 'mode = "gossip"\ngossip.rounds = %s\ngossip.local_steps = %s' "$ROUNDS" "$LOCAL_STEPS"
else
  printf 'aggregator = "tcp://127.0.0.1:%s"' "$PORT"
fi)
keys = "$DIR/keys/site-$k.key"
roster = "$DIR/roster.toml"
admin_public = "$ADMIN"
store = "$DIR/site-$k.db"
metrics = "127.0.0.1:$((METRICS_PORT + 1 + k))"
model = "$MODEL"
seed = 1
data.partition = "$PARTITION"
data.sites = $SITES
data.index = $k
data.seed = 1
training.threads = 1
EOF
    [[ -z $TOKENIZER ]] || printf 'data.tokenizer = "%s"\n' "$TOKENIZER"
    for line in "${SITE_EXTRA[@]}"; do printf '%s\n' "$line"; done
  } > "$DIR/site-$k.toml"
done
printf '%s\n' "$DIR"
