#!/usr/bin/env python3
"""The TSan leg's integration check: real processes of a ThreadSanitizer build.

Runs, one after the other, on loopback ports below Linux's ephemeral range:
  1. two `fedmesh node --mode gossip` peers (4 rounds of 5 steps, replicas);
  2. a `fedmesh aggregator` and two `fedmesh node` sites (3 sync rounds).
While they run, /metrics and /status of every process are asked again and
again (each HTTP endpoint's thread renders them while the training thread
changes what they show: the gossip `version` race of issue 29 was of this
kind), up to and through their exit. Every process must exit 0 (a TSan build
exits 66 after a report) with no "WARNING: ThreadSanitizer" on its stderr;
the stderr of any that does not is printed.

Usage: federations.py FEDMESH_BINARY LOCAL_FEDERATION_SCRIPT
(meson test sets TSAN_OPTIONS, with the suppressions, for the TSan build).
"""
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

TIMEOUT_S = 300  # per federation; each takes about 20 s under TSan


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from loopback_ports import free_ports  # noqa: E402


class Poller(threading.Thread):
    """Asks each address for /metrics and /status until stopped."""

    def __init__(self, ports):
        super().__init__(daemon=True)
        self.ports, self.answers, self.stopping = ports, 0, threading.Event()

    def run(self):
        while not self.stopping.is_set():
            for port in self.ports:
                for path in ("/metrics", "/status"):
                    try:
                        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as reply:
                            reply.read()
                            self.answers += 1
                    except OSError:
                        pass  # not listening yet, or gone
            time.sleep(0.02)


def run_federation(name, fedmesh, script, work, gossip):
    sites = 2
    port = free_ports(sites + 3)
    directory = os.path.join(work, name)
    # Gossip: peers on PORT, PORT+1; metrics on PORT+3, PORT+4 (METRICS_PORT+1+K).
    # Aggregator: PORT, metrics PORT+1; sites' metrics PORT+2, PORT+3.
    metrics = port + 2 if gossip else port + 1
    argv = ["bash", script, "--fedmesh", fedmesh, "--dir", directory, "--sites", str(sites),
            "--port", str(port), "--metrics-port", str(metrics), "--local-steps", "5",
            "--site", "data.train_limit = 600"]
    if gossip:
        argv += ["--gossip", "--rounds", "4", "--site", "gossip.test_limit = 200", "--site", "gossip.eval_every = 2"]
    else:
        argv += ["--rounds", "3", "--agg", "validation_limit = 200"]
    made = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    if made.returncode != 0:
        print(f"{name}: local_federation.sh failed:\n{made.stdout}")
        return False

    commands = []
    if not gossip:
        commands.append(("aggregator", [fedmesh, "aggregator", "--config", os.path.join(directory, "agg.toml"), "--json"]))
    for k in range(sites):
        config = os.path.join(directory, f"site-{k}.toml")
        mode = ["--mode", "gossip"] if gossip else []
        commands.append((f"site-{k}", [fedmesh, "node", *mode, "--config", config, "--json"]))
    started = time.monotonic()
    processes = []
    for label, command in commands:
        out = open(os.path.join(directory, f"{label}.out"), "w")
        err = open(os.path.join(directory, f"{label}.err"), "w")
        processes.append((label, subprocess.Popen(command, stdout=out, stderr=err), err.name))
    poller = Poller([metrics + 1 + k for k in range(sites)] + ([] if gossip else [metrics]))
    poller.start()

    ok = True
    for label, process, err in processes:
        try:
            process.wait(timeout=max(1.0, TIMEOUT_S - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            print(f"{name}: {label} still ran after {TIMEOUT_S} s (killed)")
            ok = False
    poller.stopping.set()
    poller.join()
    for label, process, err in processes:
        with open(err, encoding="utf-8", errors="replace") as f:
            text = f.read()
        races = text.count("WARNING: ThreadSanitizer")
        if process.returncode != 0 or races > 0:
            ok = False
            print(f"{name}: {label} exited {process.returncode} with {races} ThreadSanitizer report(s); its stderr:")
            # The first reports whole, then one line per distinct summary.
            print(text[:20000] + ("\n[... the rest of its stderr cut]" if len(text) > 20000 else ""))
            summaries = {}
            for line in text.splitlines():
                if line.startswith("SUMMARY: ThreadSanitizer"):
                    summaries[line] = summaries.get(line, 0) + 1
            for line, count in sorted(summaries.items(), key=lambda item: -item[1]):
                print(f"{count:6d} x {line}")
    print(f"{name}: {len(processes)} processes, {poller.answers} HTTP answers, "
          f"{time.monotonic() - started:.1f} s: {'ok' if ok else 'FAILED'}", flush=True)
    return ok


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    fedmesh, script = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    work = tempfile.mkdtemp(prefix="fedmesh-tsan-")
    try:
        ok = run_federation("gossip", fedmesh, script, work, gossip=True)
        ok = run_federation("aggregator", fedmesh, script, work, gossip=False) and ok
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
