#!/usr/bin/env bash
# Nothing lost under kills: runs a local federation of real processes
# (deploy/local_federation.sh: one `fedmesh aggregator` and N `fedmesh node`
# processes on loopback, synchronous rounds) and SIGKILLs the aggregator K
# times and a random site K times, at random moments, restarting each killed
# process at once on the same config and store. When the federation has
# finished it checks, from the aggregator's store, that every round applied
# one update of every site, none twice, and that every update a site was
# told was accepted is among them; it prints the counts and exits 1 on any
# loss or duplicate.
set -euo pipefail

usage() {
  cat <<'EOF2'
Usage: bench/crash_loop.sh [options]

Options:
  --fedmesh PATH        fedmesh binary (default: $FEDMESH_BUILD_DIR/cli/fedmesh,
                        FEDMESH_BUILD_DIR defaulting to build)
  --sites N             sites (default: 4)
  --rounds R            rounds (default: 40)
  --aggregator-kills K  SIGKILLs of the aggregator (default: 30)
  --site-kills K        SIGKILLs of a random site (default: 30)
  --gap MIN:MAX         seconds between kills, drawn uniformly (default: 0.5:2.5)
  --seed S              seed of the kill schedule (default: 1)
  --local-steps H       local steps per round (default: 10)
  --train-limit N       training images shared by the sites (default: 2000)
  --timeout S           give up after S seconds (default: 1800)
  --port P              the aggregator's port (default: random in 20000-39999)
  --out DIR             keep configs, stores and JSON lines here (default: a
                        temp dir, removed)
  -h, --help            show this help

Prints the kills made, then "rounds R, applied A (expected R x N), duplicates D,
accepted but not applied U (second reports ...: S)", and exits 0 only when
A = R x N, D = 0, U = 0. S counts updates a site sent again for a round
whose first update from it was applied (the site was killed after the
aggregator stored its update and before the site recorded it): the
aggregator stores them and refuses them as a second report of that round.
EOF2
}

die() { echo "crash_loop.sh: $*" >&2; exit 2; }

ROOT=$(cd "$(dirname "$0")/.." && pwd -P)
FEDMESH="${FEDMESH_BUILD_DIR:-$ROOT/build}/cli/fedmesh"
SITES=4 ROUNDS=40 AGG_KILLS=30 SITE_KILLS=30 GAP=0.5:2.5 SEED=1 LOCAL_STEPS=10 TRAIN_LIMIT=2000 TIMEOUT=1800
PORT=$((20000 + RANDOM % 20000)) OUT=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --fedmesh) FEDMESH=$2; shift 2 ;;
    --sites) SITES=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --aggregator-kills) AGG_KILLS=$2; shift 2 ;;
    --site-kills) SITE_KILLS=$2; shift 2 ;;
    --gap) GAP=$2; shift 2 ;;
    --seed) SEED=$2; shift 2 ;;
    --local-steps) LOCAL_STEPS=$2; shift 2 ;;
    --train-limit) TRAIN_LIMIT=$2; shift 2 ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    --port) PORT=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument $1" ;;
  esac
done
[[ -x $FEDMESH ]] || die "no fedmesh binary at $FEDMESH (build it, or give --fedmesh)"
[[ $GAP =~ ^[0-9.]+:[0-9.]+$ ]] || die "--gap takes MIN:MAX seconds"
FEDMESH=$(cd "$(dirname "$FEDMESH")" && pwd -P)/$(basename "$FEDMESH")
if [[ -n $OUT ]]; then
  mkdir -p "$OUT"
  WORK=$(cd "$OUT" && pwd -P)
else
  WORK=$(mktemp -d)
fi
ROOT_WORK=$WORK
declare -A PID
cleanup() {
  local name
  for name in "${!PID[@]}"; do kill "${PID[$name]}" 2>/dev/null || true; done
  for name in "${!PID[@]}"; do wait "${PID[$name]}" 2>/dev/null || true; done
  [[ -n $OUT ]] || rm -rf "$ROOT_WORK"
}
trap cleanup EXIT

ROOT_WORK=$WORK
WORK="$WORK/federation"  # local_federation.sh makes it
"$ROOT/deploy/local_federation.sh" --fedmesh "$FEDMESH" --dir "$WORK" --sites "$SITES" --port "$PORT" \
  --metrics-port $((PORT + 1000)) --rounds "$ROUNDS" --local-steps "$LOCAL_STEPS" --deadline 120 --model mlp \
  --agg 'validation_limit = 500' --agg 'linger_seconds = 5' --site "data.train_limit = $TRAIN_LIMIT" \
  --site 'give_up_seconds = 60' >/dev/null

start() {  # start NAME: the aggregator or site-K, output appended
  local name=$1
  if [[ $name == aggregator ]]; then
    "$FEDMESH" aggregator --config "$WORK/agg.toml" --json >> "$WORK/aggregator.jsonl" 2>> "$WORK/aggregator.err" &
  else
    "$FEDMESH" node --config "$WORK/$name.toml" --json >> "$WORK/$name.jsonl" 2>> "$WORK/$name.err" &
  fi
  PID[$name]=$!
}

finished() { grep -q '"event":"finished"' "$WORK/aggregator.jsonl" 2>/dev/null; }

start aggregator
for ((k = 0; k < SITES; k++)); do start "site-$k"; done

# The kill schedule: AGG_KILLS "aggregator" and SITE_KILLS "site" in a
# seeded random order, a seeded random gap before each.
mapfile -t SCHEDULE < <(python3 - "$SEED" "$AGG_KILLS" "$SITE_KILLS" "$SITES" "$GAP" <<'PY'
import random, sys
seed, agg, site, sites, gap = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
lo, hi = map(float, gap.split(":"))
rng = random.Random(seed)
kills = ["aggregator"] * agg + [f"site-{rng.randrange(sites)}" for _ in range(site)]
rng.shuffle(kills)
for k in kills:
    print(f"{rng.uniform(lo, hi):.3f} {k}")
PY
)
began=$(date +%s)
made_agg=0 made_site=0
for entry in "${SCHEDULE[@]}"; do
  read -r gap name <<< "$entry"
  sleep "$gap"
  finished && break
  kill -9 "${PID[$name]}" 2>/dev/null || true
  wait "${PID[$name]}" 2>/dev/null || true
  if [[ $name == aggregator ]]; then made_agg=$((made_agg + 1)); else made_site=$((made_site + 1)); fi
  start "$name"
done
echo "kills: $made_agg of the aggregator, $made_site of sites (of ${AGG_KILLS} and ${SITE_KILLS} scheduled)"
[[ $made_agg -eq $AGG_KILLS && $made_site -eq $SITE_KILLS ]] ||
  echo "crash_loop.sh: warning: the federation finished before every kill was made (more --rounds for more)" >&2
until finished; do
  (($(date +%s) - began < TIMEOUT)) || die "not finished after $TIMEOUT s (see $WORK; keep it with --out)"
  kill -0 "${PID[aggregator]}" 2>/dev/null || die "the aggregator exited before finishing (see $WORK/aggregator.err)"
  sleep 0.2
done
echo "finished after $(($(date +%s) - began)) s"
# Let the sites take the end, then stop everything; the aggregator's store
# is read only once no process owns it.
sleep 6
for name in "${!PID[@]}"; do kill "${PID[$name]}" 2>/dev/null || true; done
for name in "${!PID[@]}"; do wait "${PID[$name]}" 2>/dev/null || true; done
PID=()

python3 - "$WORK" "$SITES" "$ROUNDS" <<'PY'
import glob, json, sqlite3, sys
work, sites, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
db = sqlite3.connect(f"file:{work}/aggregator.db?mode=ro", uri=True)
rows = db.execute("SELECT update_id, round, sender FROM applied_updates").fetchall()
ids = [bytes(r[0]).decode() if isinstance(r[0], (bytes, memoryview)) else str(r[0]) for r in rows]
per_round = {}
for (_, rnd, sender) in rows:
    per_round.setdefault(rnd, []).append(sender)
duplicates = sum(len(s) - len(set(s)) for s in per_round.values())
short = {r: len(set(s)) for r, s in per_round.items() if len(set(s)) != sites}
done_rounds = db.execute("SELECT count(*) FROM round_log").fetchone()[0]
def events(path):
    """The JSON lines of one process's output (a line cut by SIGKILL skipped)."""
    for line in open(path, encoding="utf-8", errors="replace"):
        line = line.strip()
        if line.startswith("{"):
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue
# Every update a site heard accepted must be applied.
accepted = set()
for path in glob.glob(f"{work}/site-*.jsonl"):
    site = path.rsplit("/", 1)[1][: -len(".jsonl")]
    for e in events(path):
        if e.get("event") == "update" and e.get("accepted") and "sequence" in e:
            accepted.add(f"{site}/{e['sequence']}")
# A site killed after its update was stored but before it recorded so
# trains the round again and sends another update for it: the aggregator
# refuses that one as a second report of the site for the round (the
# round's first is applied). Counted apart, not as lost.
second_reports = set()
for e in events(f"{work}/aggregator.jsonl"):
    if e.get("event") == "update" and not e.get("accepted", True) and "already reported" in e.get("reason", ""):
        second_reports.add(e.get("id", ""))
missing = sorted(accepted - set(ids) - second_reports)
applied = len(rows)
print(f"rounds {len(per_round)} (round log {done_rounds}), applied {applied} (expected {rounds} x {sites} = {rounds * sites}), "
      f"duplicates {duplicates}, accepted but not applied {len(missing)} "
      f"(second reports of an applied site round, refused: {len(second_reports & accepted)})")
if short:
    print("rounds without every site:", dict(sorted(short.items())[:10]))
if missing:
    print("accepted but not applied:", missing[:10])
sys.exit(0 if applied == rounds * sites and duplicates == 0 and not missing and not short else 1)
PY
