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

--senders PATH (build/bench/bench_large_round_sender) runs the issue's
GPT-2-Large-sized round instead: `--hidden 973585` is 774M parameters,
3.1 GB in fp32. Sites of that size with their training state do not fit
six times on this machine, so each site is a sender process that sends the
deltas of a file (made once, mapped read-only by every sender) as its
dense fp32 update of each round, streamed as a sealed update from the
mapped file (bench/large_round_sender.cpp). They download nothing: a round
is the updates' transfer, staging, storing and the server step. After each
federation the same bytes (N senders x one model) go through raw CurveZMQ
PUSH -> PULL processes, and the mean round time is printed against that.

Not in CI: 12 sites of a 127 MB model need about 10 GB of memory and some
minutes on a 2-core machine; the 3.1 GB round needs tens of GB of disk.

Usage: bench/large_round.py [--fedmesh build/cli/fedmesh] [--sites 2,6,12]
                            [--hidden 40000] [--rounds 2] [--agg 'KEY = VALUE']...
                            [--senders build/bench/bench_large_round_sender]
                            [--work /var/tmp] [--validation-limit 100]
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


def tensors_of(hidden):
    """The wide MLP's parameters, in order, as the senders' --tensor flags."""
    return [f"fc1.weight:{hidden}x784", f"fc1.bias:{hidden}", f"fc2.weight:10x{hidden}", "fc2.bias:10"]


def run(fedmesh, work, sites, hidden, rounds, agg_lines, senders=None, deltas=None, validation_limit=100):
    spec = os.path.join(work, "wide.toml")
    with open(spec, "w", encoding="ascii") as f:
        f.write('name = "wide"\nlayers = [\n  { type = "linear", out = %d },\n  { type = "relu" },\n'
                '  { type = "linear" },\n]\n' % hidden)
    directory = os.path.join(work, f"sites-{sites}")
    port = free_ports(sites + 3)
    argv = ["bash", os.path.join(ROOT, "deploy", "local_federation.sh"), "--fedmesh", fedmesh, "--dir", directory,
            "--sites", str(sites), "--port", str(port), "--metrics-port", str(port + 1), "--rounds", str(rounds),
            "--local-steps", "1", "--model", spec, "--deadline", "600",
            "--site", "data.train_limit = 64", "--agg", f"validation_limit = {validation_limit}"]
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
        config = os.path.join(directory, f"site-{k}.toml")
        if senders:
            argv = [senders, "site", "--config", config, "--deltas", deltas]
            for tensor in tensors_of(hidden):
                argv += ["--tensor", tensor]
        else:
            argv = [fedmesh, "node", "--config", config, "--json"]
        nodes.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
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
    round_seconds = []
    with open(out.name, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "round":
                round_seconds.append(float(event.get("seconds", 0.0)))
    return peak, listening, seconds, round_seconds, traffic(directory, sites)


def traffic(directory, sites):
    """What the sites' logs say of the uploads: accepted, answered busy, and
    the attempts of the accepted ones past their first (a timed-out attempt
    resends its window)."""
    accepted = busy = extra_attempts = 0
    sender_anonymous_kb = 0
    for k in range(sites):
        with open(os.path.join(directory, f"site-{k}.out"), encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                sender_anonymous_kb = max(sender_anonymous_kb, int(event.get("peak_anonymous_kb", 0)))
                if event.get("event") != "update":
                    continue
                busy += int(event.get("busy", 0))  # a sender's offers answered BUSY before this outcome
                if event.get("accepted"):
                    accepted += 1
                    extra_attempts += max(0, int(event.get("attempts", 1)) - 1)
                elif event.get("code") == "busy":
                    busy += 1
    said = f"uploads: {accepted} accepted ({extra_attempts} attempts past the first), {busy} answered busy"
    if sender_anonymous_kb:
        said += f"; a sender's peak anonymous memory {sender_anonymous_kb / 1e3:.0f} MB"
    return said


def raw_baseline(sender, work, sites, deltas, model_bytes):
    """Seconds for `sites` raw CurveZMQ senders to push one model's bytes
    each from the mapped deltas into one PULL process (first byte to last)."""
    port = free_ports(1)
    key = os.path.join(work, f"raw-{sites}.key")
    receiver = subprocess.Popen([sender, "raw-receive", "--bind", f"tcp://127.0.0.1:{port}", "--key-out", key,
                                 "--bytes", str(sites * model_bytes)], stdout=subprocess.PIPE, text=True)
    pushers = [subprocess.Popen([sender, "raw-send", "--connect", f"tcp://127.0.0.1:{port}", "--key", key,
                                 "--deltas", deltas, "--bytes", str(model_bytes)]) for _ in range(sites)]
    out, _ = receiver.communicate(timeout=1800)
    for pusher in pushers:
        pusher.wait(timeout=120)
    if receiver.returncode != 0:
        sys.exit(f"the raw CurveZMQ receiver exited {receiver.returncode}")
    return json.loads(out.strip().splitlines()[-1])["seconds"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fedmesh", default=os.path.join(ROOT, "build", "cli", "fedmesh"))
    parser.add_argument("--sites", default="2,6,12")
    parser.add_argument("--hidden", type=int, default=40000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--agg", action="append", default=[], help="one more line of agg.toml")
    parser.add_argument("--senders", help="bench_large_round_sender: sites that send a file's deltas")
    parser.add_argument("--work", default=None, help="where the federations' files go (default: a temporary dir)")
    parser.add_argument("--validation-limit", type=int, default=100, help="the aggregator's validation images")
    args = parser.parse_args()
    parameters = 784 * args.hidden + args.hidden + args.hidden * 10 + 10
    model_mb = parameters * 4 / 1e6
    print(f"model: {parameters / 1e6:.1f}M parameters, {model_mb:.0f} MB in fp32; rounds: {args.rounds}", flush=True)
    work = tempfile.mkdtemp(prefix="fedmesh-large-round-", dir=args.work)
    senders = os.path.abspath(args.senders) if args.senders else None
    deltas = None
    peaks = []
    try:
        if senders:
            deltas = os.path.join(work, "deltas.f32")
            subprocess.run([senders, "make-deltas", deltas, "--values", str(parameters)], check=True,
                           stdout=subprocess.DEVNULL)
        for sites in [int(s) for s in args.sites.split(",")]:
            peak, listening, seconds, rounds, uploads = run(os.path.abspath(args.fedmesh), work, sites, args.hidden,
                                                            args.rounds, args.agg, senders, deltas,
                                                            args.validation_limit)
            peaks.append(peak)
            print(f"sites {sites:3d}: aggregator peak RSS {peak * 1.024e-3:.0f} MB = {peak * 1.024e-3 / model_mb:.2f}x "
                  f"the model ({listening * 1.024e-3:.0f} MB when listening; the rounds added "
                  f"{(peak - listening) * 1.024e-3 / model_mb:.2f}x); {seconds:.1f} s for {args.rounds} rounds "
                  f"(rounds: {', '.join(f'{r:.1f}' for r in rounds)} s); {uploads}", flush=True)
            if senders and rounds:
                raw = raw_baseline(senders, work, sites, deltas, parameters * 4)
                mean = sum(rounds) / len(rounds)
                print(f"           raw CurveZMQ, the same bytes ({sites} x {model_mb:.0f} MB) from {sites} senders: "
                      f"{raw:.1f} s; mean round {mean:.1f} s = {mean / raw:.2f}x raw (FLARE's streaming: 81.75 GiB, "
                      f"about 154 s a round for 6 clients)", flush=True)
            shutil.rmtree(os.path.join(work, f"sites-{sites}"), ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if len(peaks) > 1:
        print(f"peak RSS from the fewest sites to the most: {peaks[-1] / peaks[0]:.3f}x "
              f"(flat within 10 %: {'yes' if abs(peaks[-1] / peaks[0] - 1) <= 0.10 else 'no'})")


if __name__ == "__main__":
    main()
