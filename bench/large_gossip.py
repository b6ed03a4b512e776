#!/usr/bin/env python3
"""Issues 28 and 30: gossip replica peers with a model of a gigabyte.

Runs N real `fedmesh node --mode gossip` peers on loopback
(deploy/local_federation.sh --gossip) with a one-hidden-layer MLP spec whose
width sets its size (default 320000: 254.4M parameters, 1.02 GB in fp32), the
replicas merge rule and its default compression (top-k 1.5 % with int8
values, error-fed). Each peer trains one step on 64 images a round, makes its
update, commits it, sends it to the other, applies the other's; at the end
every peer must hold the same replica (equal digests of the exact sum, every
update applied, none missing).

Prints, per peer, its peak resident set (VmHWM of /proc/PID/status, read every
0.2 s) as a multiple of the model, its bytes sent, the store's size on disk;
then the wall time, and whether the replicas agree. Exits 1 if they do not or
a peer fails.

Not in CI: two peers of a 1 GB model need about 20 GB of memory and 20 GB of
disk (keep_last 1: each commit holds the model, the residual and the 8-byte
exact sum, about 4x the model) and several minutes on a 2-core machine.

Usage: bench/large_gossip.py [--fedmesh build/cli/fedmesh] [--hidden 320000]
                             [--peers 2] [--rounds 2] [--keep-last 1]
                             [--dir /var/tmp] [--site 'KEY = VALUE']...
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
from peak_memory import peak_kb  # noqa: E402


def store_bytes(directory, k):
    total = 0
    for suffix in ("", "-wal", "-shm"):
        path = os.path.join(directory, f"site-{k}.db{suffix}")
        if os.path.exists(path):
            total += os.path.getsize(path)
    return total


def events(path):
    found = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                try:
                    found.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fedmesh", default=os.path.join(ROOT, "build", "cli", "fedmesh"))
    parser.add_argument("--hidden", type=int, default=320000)
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--keep-last", type=int, default=1)
    parser.add_argument("--dir", default="/var/tmp", help="where the peers' stores go (needs ~10x the model)")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--site", action="append", default=[], help="one more line of every peer's config")
    args = parser.parse_args()
    if args.peers < 2 or args.rounds < 1 or args.keep_last < 1 or args.hidden < 1:
        sys.exit("--peers must be at least 2, --rounds, --keep-last and --hidden at least 1")
    parameters = 784 * args.hidden + args.hidden + args.hidden * 10 + 10
    model_mb = parameters * 4 / 1e6
    print(f"model: {parameters / 1e6:.1f}M parameters, {model_mb:.0f} MB in fp32; {args.peers} gossip peers, "
          f"{args.rounds} rounds, keep_last {args.keep_last}", flush=True)
    fedmesh = os.path.abspath(args.fedmesh)
    work = tempfile.mkdtemp(prefix="fedmesh-large-gossip-", dir=args.dir)
    try:
        spec = os.path.join(work, "wide.toml")
        with open(spec, "w", encoding="ascii") as f:
            f.write('name = "wide"\nlayers = [\n  { type = "linear", out = %d },\n  { type = "relu" },\n'
                    '  { type = "linear" },\n]\n' % args.hidden)
        directory = os.path.join(work, "peers")
        port = free_ports(2 * args.peers + 2)
        argv = ["bash", os.path.join(ROOT, "deploy", "local_federation.sh"), "--fedmesh", fedmesh, "--dir", directory,
                "--sites", str(args.peers), "--port", str(port), "--metrics-port", str(port + args.peers + 1),
                "--rounds", str(args.rounds), "--local-steps", "1", "--gossip", "--model", spec,
                "--site", "data.train_limit = 64", "--site", f"keep_last = {args.keep_last}",
                "--site", "gossip.test_limit = 200"]
        for line in args.site:
            argv += ["--site", line]
        made = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if made.returncode != 0:
            sys.exit(f"local_federation.sh failed:\n{made.stdout}")
        started = time.monotonic()
        peers, peaks, disk = [], [0] * args.peers, [0] * args.peers
        for k in range(args.peers):
            out = open(os.path.join(directory, f"site-{k}.out"), "w")
            err = open(os.path.join(directory, f"site-{k}.err"), "w")
            peers.append(subprocess.Popen([fedmesh, "node", "--config", os.path.join(directory, f"site-{k}.toml"),
                                           "--json"], stdout=out, stderr=err))
        while any(p.poll() is None for p in peers):
            if time.monotonic() - started > args.timeout:
                for p in peers:
                    p.kill()
                sys.exit(f"the peers did not finish within {args.timeout:.0f} s")
            for k, p in enumerate(peers):
                seen = peak_kb(p.pid) if p.poll() is None else None
                if seen:
                    peaks[k] = max(peaks[k], seen)
                disk[k] = max(disk[k], store_bytes(directory, k))
            time.sleep(0.2)
        seconds = time.monotonic() - started
        failed = False
        digests = set()
        for k, p in enumerate(peers):
            finished = [e for e in events(os.path.join(directory, f"site-{k}.out")) if e.get("event") == "finished"]
            if p.returncode != 0 or not finished:
                with open(os.path.join(directory, f"site-{k}.err"), encoding="utf-8", errors="replace") as f:
                    print(f"peer {k} exited {p.returncode}:\n{f.read()[-3000:]}", flush=True)
                failed = True
                continue
            last = finished[-1]
            digests.add(last.get("replica_digest"))
            missing = last.get("updates_missing", {})
            if missing or last.get("updates_applied") != args.peers * args.rounds:
                failed = True
            print(f"peer {k}: peak RSS {peaks[k] / 1024:.0f} MB = {peaks[k] * 1.024e-3 / model_mb:.2f}x the model; "
                  f"{last.get('bytes_sent', 0) / 1e6:.1f} MB sent; store up to {disk[k] / 1e9:.2f} GB on disk; "
                  f"{last.get('updates_applied')} updates applied, missing {missing or 'none'}; "
                  f"test accuracy {last.get('test_accuracy')}", flush=True)
        agree = len(digests) == 1 and not failed
        print(f"{args.rounds} rounds in {seconds:.1f} s; replicas identical: {'yes' if agree else 'NO'}"
              f"{' (digest ' + next(iter(digests))[:16] + ')' if agree else ''}", flush=True)
        if not agree:
            # The peers' logs stay for a look; their stores (gigabytes) go.
            for name in os.listdir(directory):
                if ".db" in name:
                    os.remove(os.path.join(directory, name))
            print(f"the peers' output is kept in {directory}", flush=True)
            work = None
            sys.exit(1)
    finally:
        if work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
