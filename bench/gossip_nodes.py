#!/usr/bin/env python3
"""Wall time and bytes to 80% test accuracy for 8 real fedmesh processes on
loopback: gossip peers (`fedmesh node --mode gossip`) per topology and
compression, against the aggregator path (`fedmesh aggregator` + 8
`fedmesh node`) on the same task, in the same run, on the same machine.

Task: Fashion-MNIST, Dirichlet(0.5) over 8 sites, the mlp, plain SGD
(lr 0.1, no momentum), batch 32, 10 local steps per round, 16 000 training
images, 2000 test images. Reached means:
  gossip      the mean over the 8 peers of each one's latest test accuracy
              >= the target (every peer evaluates every 2 rounds);
  aggregator  the global model's test accuracy >= the target.
Bytes are everything handed to the sockets (framed messages): for gossip
the sum over peers of transport_bytes_sent (shares, catch-up, membership);
for the aggregator its socket's bytes sent plus received (models down,
updates and reports up, heartbeats).

Usage: bench/gossip_nodes.py --fedmesh build/cli/fedmesh [--quick] [--target 0.8]
"""
import argparse
import json
import os
import selectors
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SITES = 8
COMMON = ["data.train_limit = 16000", "training.lr = 0.1", "training.momentum = 0.0"]


def make(fedmesh, directory, port, gossip, site_lines, agg_lines=(), rounds=0):
    argv = ["bash", os.path.join(ROOT, "deploy", "local_federation.sh"), "--fedmesh", fedmesh, "--dir", directory,
            "--sites", str(SITES), "--port", str(port), "--metrics-port", str(port + 50), "--local-steps", "10",
            "--rounds", str(rounds)]
    if gossip:
        argv.append("--gossip")
    for line in COMMON + list(site_lines):
        argv += ["--site", line]
    for line in agg_lines:
        argv += ["--agg", line]
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)


def run(processes, on_event, timeout):
    """Reads JSON lines from every process until on_event returns True."""
    selector = selectors.DefaultSelector()
    buffers = {}
    for name, process in processes.items():
        selector.register(process.stdout, selectors.EVENT_READ, name)
        buffers[name] = b""
    deadline = time.time() + timeout
    try:
        while time.time() < deadline:
            for key, _ in selector.select(timeout=0.5):
                name = key.data
                chunk = os.read(key.fileobj.fileno(), 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffers[name] += chunk
                while b"\n" in buffers[name]:
                    line, buffers[name] = buffers[name].split(b"\n", 1)
                    try:
                        event = json.loads(line)
                    except ValueError:
                        continue
                    if on_event(name, event):
                        return True
        return False
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.terminate()
        for process in processes.values():
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()


def gossip_case(fedmesh, port, topology, fanout, compress, merge, target, timeout):
    directory = tempfile.mkdtemp(prefix="fedmesh-gossip-bench-")
    shutil.rmtree(directory)
    make(fedmesh, directory, port, True,
         ['gossip.topology = "%s"' % topology, "gossip.fanout = %d" % fanout, 'gossip.merge = "%s"' % merge,
          'compression.default = "%s"' % compress, "gossip.test_limit = 2000", "gossip.eval_every = 2"])
    start = time.time()
    processes = {k: subprocess.Popen([fedmesh, "node", "--config", os.path.join(directory, "site-%d.toml" % k), "--json"],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) for k in range(SITES)}
    accuracy, transport, rounds = {}, {}, {}
    result = {}

    def on_event(name, event):
        if event.get("event") != "round":
            return False
        transport[name] = event.get("transport_bytes_sent", 0)
        rounds[name] = event.get("round", 0)
        if "test_accuracy" in event:
            accuracy[name] = event["test_accuracy"]
        if len(accuracy) == SITES and sum(accuracy.values()) / SITES >= target:
            result.update(seconds=time.time() - start, bytes=sum(transport.values()),
                          rounds=sum(rounds.values()) / len(rounds), accuracy=sum(accuracy.values()) / SITES,
                          worst=min(accuracy.values()))
            return True
        return False

    reached = run(processes, on_event, timeout)
    shutil.rmtree(directory, ignore_errors=True)
    if not reached:
        result = dict(seconds=None, bytes=sum(transport.values()), rounds=max(rounds.values(), default=0),
                      accuracy=sum(accuracy.values()) / max(1, len(accuracy)), worst=min(accuracy.values(), default=0))
    return result


def aggregator_case(fedmesh, port, compress, target, timeout):
    directory = tempfile.mkdtemp(prefix="fedmesh-agg-bench-")
    shutil.rmtree(directory)
    make(fedmesh, directory, port, False, ['compression.default = "%s"' % compress, "training.batch_size = 32"],
         agg_lines=["validation_limit = 2000", "strategy = \"fedavg\""], rounds=400)
    start = time.time()
    processes = {"aggregator": subprocess.Popen([fedmesh, "aggregator", "--config", os.path.join(directory, "agg.toml"),
                                                 "--json"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)}
    time.sleep(0.5)
    for k in range(SITES):
        processes["site-%d" % k] = subprocess.Popen(
            [fedmesh, "node", "--config", os.path.join(directory, "site-%d.toml" % k), "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    result = {}
    last = {}

    def on_event(name, event):
        if name != "aggregator" or event.get("event") != "round":
            return False
        last.update(event)
        if event.get("test_accuracy", 0.0) >= target:
            result.update(seconds=time.time() - start,
                          bytes=event.get("bytes_sent", 0) + event.get("bytes_received", 0),
                          rounds=event.get("round", 0), accuracy=event["test_accuracy"], worst=event["test_accuracy"])
            return True
        return False

    reached = run(processes, on_event, timeout)
    shutil.rmtree(directory, ignore_errors=True)
    if not reached:
        result = dict(seconds=None, bytes=last.get("bytes_sent", 0) + last.get("bytes_received", 0),
                      rounds=last.get("round", 0), accuracy=last.get("test_accuracy", 0.0),
                      worst=last.get("test_accuracy", 0.0))
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fedmesh", default=os.path.join(ROOT, "build", "cli", "fedmesh"))
    parser.add_argument("--target", type=float, default=0.80)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
    parser.add_argument("--port", type=int, default=31000)
    parser.add_argument("--quick", action="store_true", help="exponential and one-peer-exponential only")
    args = parser.parse_args()
    if not os.access(args.fedmesh, os.X_OK):
        sys.exit("gossip_nodes.py: no fedmesh binary at %s (build first, or pass --fedmesh)" % args.fedmesh)
    gossip_cases = [("exponential", 1, "int8", "push-sum"), ("one-peer-exponential", 1, "int8", "push-sum"),
                    ("exponential", 1, "identity", "push-sum")]
    if not args.quick:
        gossip_cases += [("ring", 2, "int8", "push-sum"), ("random", 2, "int8", "push-sum"),
                         ("exponential", 1, "int8", "pairwise"), ("exponential", 1, "fp16", "push-sum")]
    rows = []
    port = args.port
    for compress in ["int8", "identity"]:
        print("aggregator, %s ..." % compress, file=sys.stderr, flush=True)
        rows.append(("aggregator (FedAvg)", compress, aggregator_case(args.fedmesh, port, compress, args.target,
                                                                      args.timeout)))
        port += 100
    for topology, fanout, compress, merge in gossip_cases:
        label = "gossip %s%s, %s" % (topology, " f=%d" % fanout if topology in ("ring", "random") else "", merge)
        print("%s, %s ..." % (label, compress), file=sys.stderr, flush=True)
        rows.append((label, compress, gossip_case(args.fedmesh, port, topology, fanout, compress, merge, args.target,
                                                  args.timeout)))
        port += 100
    base = {compress: r for name, compress, r in rows if name.startswith("aggregator")}
    print("8 processes on loopback, %d cores; target %.0f%% test accuracy (gossip: mean over peers)" %
          (os.cpu_count(), 100 * args.target))
    print("| path | compression | reached in | rounds | bytes | bytes vs aggregator (same compression) | time vs aggregator | accuracy (worst peer) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, compress, r in rows:
        reference = base.get(compress)
        seconds = "%.1f s" % r["seconds"] if r["seconds"] else "not reached in %.0f s" % args.timeout
        ratio_bytes = ratio_time = "-"
        if reference and reference["seconds"] and r["seconds"] and not name.startswith("aggregator"):
            ratio_bytes = "%.2f×" % (r["bytes"] / reference["bytes"])
            ratio_time = "%.2f×" % (r["seconds"] / reference["seconds"])
        print("| %s | %s | %s | %.0f | %.1f MB | %s | %s | %.3f (%.3f) |" % (
            name, compress, seconds, r["rounds"], r["bytes"] / 1e6, ratio_bytes, ratio_time, r["accuracy"], r["worst"]))


if __name__ == "__main__":
    main()
