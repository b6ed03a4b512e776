#!/usr/bin/env python3
"""Table and plot for bench/gossip_replicas.sh.

Reads OUT/<setting>.jsonl (`fedmesh sim --json`: round events, then the
summary) and writes a Markdown table to stdout and OUT/table.md (final mean
and worst-peer test accuracy, points behind the aggregator, bytes sent, and
the byte ratio against `replicas-dense`, the same run with dense fp32
updates), and OUT/accuracy_vs_bytes.png: mean test accuracy against the
cumulative bytes sent (log x), one line per setting (--copy-png PATH writes a
copy). The table needs only the standard library; the plot needs matplotlib
(Debian: apt-get install -y python3-matplotlib).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ORDER = ["aggregator", "replicas-topk1.5", "replicas-topk1", "replicas-dense", "push-sum-old-defaults"]


def load(path: Path):
    curve, summary = [], None
    for line in path.read_text().splitlines():
        event = json.loads(line)
        if event.get("event") == "round" and "test_accuracy" in event:
            curve.append((event.get("bytes_sent", event.get("bytes", 0)), event["test_accuracy"]))
        if event.get("event") == "summary":
            summary = event
    return curve, summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--copy-png", type=Path)
    args = parser.parse_args()
    runs = {}
    for name in ORDER:
        path = args.out / f"{name}.jsonl"
        if path.exists():
            runs[name] = load(path)
    if "aggregator" not in runs:
        print(f"plot_gossip.py: no aggregator.jsonl in {args.out}", file=sys.stderr)
        return 2
    # The aggregator's summary counts the uplink; its per-round events carry
    # the bytes of that round: make the curve cumulative.
    total, curve = 0, []
    for round_bytes, accuracy in runs["aggregator"][0]:
        total += round_bytes
        curve.append((total, accuracy))
    runs["aggregator"] = (curve, runs["aggregator"][1])
    reference = runs["aggregator"][1]["test_accuracy"]
    dense = runs.get("replicas-dense", (None, None))[1]
    lines = ["| setting | mean accuracy | worst peer | behind the aggregator | bytes sent | dense fp32 / this |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, (curve, summary) in runs.items():
        mean = summary["test_accuracy"]
        worst = summary.get("min_test_accuracy", mean)
        sent = summary["bytes_sent"]
        ratio = f"{dense['bytes_sent'] / sent:.0f}x" if dense and name.startswith("replicas") else "-"
        lines.append(f"| {name} | {100 * mean:.2f} % | {100 * worst:.2f} % | {100 * (reference - mean):+.2f} | "
                     f"{sent / 1e6:.1f} MB | {ratio} |")
    table = "\n".join(lines)
    print(table)
    (args.out / "table.md").write_text(table + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_gossip.py: matplotlib is missing (apt-get install -y python3-matplotlib): no plot", file=sys.stderr)
        return 0
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, (curve, _) in runs.items():
        if curve:
            ax.plot([max(b, 1) / 1e6 for b, _ in curve], [100 * a for _, a in curve], marker=".", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent, all sites or peers (MB, log)")
    ax.set_ylabel("mean test accuracy (%)")
    ax.set_title("Fashion-MNIST, Dirichlet(0.5), 40 rounds; gossip with 20 % loss")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    png = args.out / "accuracy_vs_bytes.png"
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    if args.copy_png:
        shutil.copyfile(png, args.copy_png)
    print(f"plot: {png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
