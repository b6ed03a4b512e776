#!/usr/bin/env python3
"""Issue 30: the aggregator's peak memory against the number of sites.

Runs a real `fedmesh aggregator` and N real `fedmesh node` sites on loopback
(deploy/local_federation.sh) with a large model, a one-hidden-layer MLP spec
whose width sets its size (default 40000: 31.8M parameters, 127 MB in fp32),
for each N given, one federation after the other. Sites train one step on 64
images a round, so the round is the updates' transfer and aggregation.
Prints, per N, the aggregator's peak resident set (VmHWM of
/proc/PID/status, read every 0.2 s until it exits) as a multiple of the model
and the time its rounds took, then how much the peak moved from the smallest
N to the largest (the bar: flat within 10 %).

Not in CI: 12 sites of a 127 MB model need about 10 GB of memory and some
minutes on a 2-core machine.

Usage: bench/large_round.py [--fedmesh build/cli/fedmesh] [--sites 2,6,12]
                            [--hidden 40000] [--rounds 2] [--agg 'KEY = VALUE']...
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))
from loopback_ports import free_ports  # noqa: E402
from peak_memory import peak_kb, status_kb  # noqa: E402


def run(fedmesh, work, sites, hidden, rounds, agg_lines):
    spec = os.path.join(work, "wide.toml")
    with open(spec, "w", encoding="ascii") as f:
        f.write('name = "wide"\nlayers = [\n  { type = "linear", out = %d },\n  { type = "relu" },\n'
                '  { type = "linear" },\n]\n' % hidden)
    directory = os.path.join(work, f"sites-{sites}")
    port = free_ports(sites + 3)
    argv = ["bash", os.path.join(ROOT, "deploy", "local_federation.sh"), "--fedmesh", fedmesh, "--dir", directory,
            "--sites", str(sites), "--port", str(port), "--metrics-port", str(port + 1), "--rounds", str(rounds),
            "--local-steps", "1", "--model", spec, "--deadline", "600",
            "--site", "data.train_limit = 64", "--agg", "validation_limit = 100"]
    for line in agg_lines:
        argv += ["--agg", line]
    made = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if made.returncode != 0:
        sys.exit(f"local_federation.sh failed:\n{made.stdout}")
    out = open(os.path.join(directory, "aggregator.out"), "w")
    err = open(os.path.join(directory, "aggregator.err"), "w")
    started = time.monotonic()
    aggregator = subprocess.Popen([fedmesh, "aggregator", "--config", os.path.join(directory, "agg.toml"), "--json"],
                                  stdout=out, stderr=err)
    # Its resident set once listening (libraries, the model, the evaluator),
    # before any site: what the rounds add is measured from there.
    listening = 0
    for _ in range(600):
        with open(out.name, encoding="utf-8", errors="replace") as f:
            if any('"listening"' in line for line in f):
                listening = status_kb(aggregator.pid, "VmRSS") or 0
                break
        if aggregator.poll() is not None:
            break
        time.sleep(0.1)
    nodes = []
    for k in range(sites):
        log = open(os.path.join(directory, f"site-{k}.out"), "w")
        nodes.append(subprocess.Popen([fedmesh, "node", "--config", os.path.join(directory, f"site-{k}.toml"),
                                       "--json"], stdout=log, stderr=subprocess.STDOUT))
    peak = 0
    while aggregator.poll() is None:
        seen = peak_kb(aggregator.pid)
        if seen:
            peak = max(peak, seen)
        time.sleep(0.2)
    seconds = time.monotonic() - started
    for node in nodes:
        try:
            node.wait(timeout=60)
        except subprocess.TimeoutExpired:
            node.kill()
    if aggregator.returncode != 0:
        with open(err.name, encoding="utf-8", errors="replace") as f:
            sys.exit(f"the aggregator of {sites} sites exited {aggregator.returncode}:\n{f.read()[-4000:]}")
    with open(out.name, encoding="utf-8", errors="replace") as f:
        steps = sum(1 for line in f if line.replace(" ", "").startswith('{"event":"round",'))
    return peak, listening, seconds, steps, traffic(directory, sites)


def traffic(directory, sites):
    """What the sites' logs say of the uploads: accepted, answered busy, and
    the attempts of the accepted ones past their first (a timed-out attempt
    resends its window)."""
    accepted = busy = extra_attempts = 0
    for k in range(sites):
        with open(os.path.join(directory, f"site-{k}.out"), encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if event.get("event") != "update":
                    continue
                if event.get("accepted"):
                    accepted += 1
                    extra_attempts += max(0, int(event.get("attempts", 1)) - 1)
                elif event.get("code") == "busy":
                    busy += 1
    return f"uploads: {accepted} accepted ({extra_attempts} attempts past the first), {busy} answered busy"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fedmesh", default=os.path.join(ROOT, "build", "cli", "fedmesh"))
    parser.add_argument("--sites", default="2,6,12")
    parser.add_argument("--hidden", type=int, default=40000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--agg", action="append", default=[], help="one more line of agg.toml")
    args = parser.parse_args()
    parameters = 784 * args.hidden + args.hidden + args.hidden * 10 + 10
    model_mb = parameters * 4 / 1e6
    print(f"model: {parameters / 1e6:.1f}M parameters, {model_mb:.0f} MB in fp32; rounds: {args.rounds}", flush=True)
    work = tempfile.mkdtemp(prefix="fedmesh-large-round-")
    peaks = []
    try:
        for sites in [int(s) for s in args.sites.split(",")]:
            peak, listening, seconds, steps, uploads = run(os.path.abspath(args.fedmesh), work, sites, args.hidden,
                                                           args.rounds, args.agg)
            peaks.append(peak)
            print(f"sites {sites:3d}: aggregator peak RSS {peak * 1.024e-3:.0f} MB = {peak * 1.024e-3 / model_mb:.2f}x "
                  f"the model ({listening * 1.024e-3:.0f} MB when listening; the rounds added "
                  f"{(peak - listening) * 1.024e-3 / model_mb:.2f}x); {seconds:.1f} s for {args.rounds} rounds; "
                  f"{uploads}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if len(peaks) > 1:
        print(f"peak RSS from the fewest sites to the most: {peaks[-1] / peaks[0]:.3f}x "
              f"(flat within 10 %: {'yes' if abs(peaks[-1] / peaks[0] - 1) <= 0.10 else 'no'})")


if __name__ == "__main__":
    main()
