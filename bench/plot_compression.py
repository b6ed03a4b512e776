#!/usr/bin/env python3
"""Table and plot for the update-compression experiments.

Reads OUT/<setting>__seed<S>.jsonl (the JSON lines of `fedmesh sim --json`,
written by bench/compression_experiments.sh) and writes

  * a Markdown table to stdout and OUT/table.md: per setting the final test
    accuracy (mean +- sample std over seeds), its difference to the dense
    fp32 baseline in points, the mean of the last 5 rounds, the bytes sent per
    run (uplink updates on the wire), the reduction factor (dense bytes /
    setting bytes), the bytes to target (cumulative bytes until the
    seed-averaged accuracy first reaches dense's mean final accuracy - 1
    point) and whether the setting meets "at least 100x fewer bytes within
    0.5 points of dense";
  * OUT/accuracy_vs_bytes.png: seed-averaged test accuracy against
    cumulative bytes sent (log x), one line per setting (--copy-png PATH
    writes a copy, e.g. the one committed next to this script).

Only the standard library is needed for the table; the plot needs matplotlib
(Debian: apt-get install -y python3-matplotlib).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import statistics
import sys
from pathlib import Path

DENSE = "dense"
TARGET_FACTOR = 100.0      # at least this many times fewer bytes than dense
TARGET_POINTS = 0.5        # within this many points of dense's final accuracy
BTT_POINTS = 1.0           # bytes-to-target: dense final - this many points
LAST_K = 5                 # the "last rounds" column averages this many rounds

FILE_RE = re.compile(r"^(?P<label>.+)__seed(?P<seed>\d+)\.jsonl$")


def read_run(path: Path):
    """Per-round (accuracy, bytes) and the summary of one run."""
    rounds = {}
    summary = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        event = json.loads(line)
        if event.get("event") == "round":
            rounds[int(event["round"])] = (float(event["test_accuracy"]), int(event["bytes"]))
        elif event.get("event") == "summary":
            summary = event
    if summary is None:
        return None
    ordered = [rounds[r] for r in sorted(rounds)]
    return {"acc": [a for a, _ in ordered], "bytes": [b for _, b in ordered],
            "final": float(summary["test_accuracy"]), "bytes_sent": int(summary["bytes_sent"])}


def cumulative(values):
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out


def load(out_dir: Path):
    order, flags = [], {}
    tsv = out_dir / "settings.tsv"
    if tsv.exists():
        for line in tsv.read_text().splitlines():
            if "\t" in line:
                label, f = line.split("\t", 1)
                order.append(label)
                flags[label] = f
    runs: dict[str, dict[int, dict]] = {}
    for path in sorted(out_dir.glob("*__seed*.jsonl")):
        m = FILE_RE.match(path.name)
        if not m:
            continue
        run = read_run(path)
        if run is None:
            print(f"plot_compression.py: {path} has no summary line (unfinished run), ignored", file=sys.stderr)
            continue
        runs.setdefault(m["label"], {})[int(m["seed"])] = run
    labels = [l for l in order if l in runs] + sorted(l for l in runs if l not in order)
    return labels, flags, runs


def aggregate(seed_runs: dict[int, dict]):
    seeds = sorted(seed_runs)
    n_rounds = min(len(seed_runs[s]["acc"]) for s in seeds)
    acc = [statistics.fmean(seed_runs[s]["acc"][r] for s in seeds) for r in range(n_rounds)]
    cum = [statistics.fmean(cumulative(seed_runs[s]["bytes"])[r] for s in seeds) for r in range(n_rounds)]
    finals = [seed_runs[s]["final"] for s in seeds]
    last_k = [statistics.fmean(seed_runs[s]["acc"][-LAST_K:]) for s in seeds]
    return {
        "seeds": seeds,
        "rounds": n_rounds,
        "acc": acc,
        "cum": cum,
        "final_mean": statistics.fmean(finals),
        "final_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
        "last_k": statistics.fmean(last_k),
        "bytes": statistics.fmean(seed_runs[s]["bytes_sent"] for s in seeds),
    }


def fmt_bytes(b: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            v = b / scale
            return f"{v:.3g} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{b:.0f} B"


def fmt_factor(f: float) -> str:
    # Rounded down, so that 99.96x never reads as "100x".
    if math.isinf(f):
        return "∞"
    digits = 2 if f < 10 else 1 if f < 100 else 0
    return f"{math.floor(f * 10**digits) / 10**digits:.{digits}f}×"


def bytes_to_target(agg, target: float):
    for r, a in enumerate(agg["acc"]):
        if a >= target:
            return agg["cum"][r], r + 1
    return None


def table(labels, flags, aggs) -> tuple[str, list[str]]:
    dense = aggs.get(DENSE)
    lines = []
    if dense is None:
        return "No dense baseline (dense__seed*.jsonl) found; nothing to compare against.\n", []
    target = dense["final_mean"] - BTT_POINTS / 100.0
    seeds = ", ".join(str(s) for s in dense["seeds"])
    lines.append(f"Dense fp32 baseline: {100 * dense['final_mean']:.2f} % final test accuracy "
                 f"(mean of seeds {seeds}, {dense['rounds']} rounds); bytes-to-target threshold "
                 f"{100 * target:.2f} % (dense − {BTT_POINTS:g} point, seed-averaged curve).")
    lines.append("")
    lines.append("| setting | final accuracy % (mean ± std) | vs dense (points) | last "
                 f"{LAST_K} rounds % | bytes sent per run | reduction vs dense | bytes to target (round) "
                 "| ≥ 100× within 0.5 points |")
    lines.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
    met = []
    for label in labels:
        a = aggs[label]
        delta = 100 * (a["final_mean"] - dense["final_mean"])
        factor = dense["bytes"] / a["bytes"] if a["bytes"] > 0 else math.inf
        btt = bytes_to_target(a, target)
        btt_text = f"{fmt_bytes(btt[0])} (r {btt[1]})" if btt else "not reached"
        ok = factor >= TARGET_FACTOR and delta >= -TARGET_POINTS
        if label == DENSE:
            verdict = "baseline"
        else:
            verdict = "**yes**" if ok else "no"
            if ok:
                met.append(label)
        n = len(a["seeds"])
        std = f" ± {100 * a['final_std']:.2f}" if n > 1 else ""
        name = f"`{label}`" + (f" ({n} seeds)" if n != len(dense["seeds"]) else "")
        lines.append(f"| {name} | {100 * a['final_mean']:.2f}{std} | {delta:+.2f} | {100 * a['last_k']:.2f} | "
                     f"{fmt_bytes(a['bytes'])} | {fmt_factor(factor)} | {btt_text} | {verdict} |")
    lines.append("")
    if met:
        lines.append("Meet ≥ 100× fewer bytes within 0.5 points of dense: " + ", ".join(f"`{m}`" for m in met) + ".")
    else:
        lines.append("No setting meets ≥ 100× fewer bytes within 0.5 points of dense.")
    lines.append("")
    lines.append("Flags per setting (on top of the fixed ones): " +
                 "; ".join(f"`{l}`: `{flags[l]}`" for l in labels if l in flags) + ".")
    return "\n".join(lines) + "\n", met


def plot(labels, aggs, path: Path, dense_final: float | None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    family_style = {"fp16": "-", "bf16": "-", "int8": "--", "int4": "--",
                    "topk": "-.", "powersgd": ":", "dct-sign": (0, (5, 1, 1, 1, 1, 1))}
    tab20 = plt.get_cmap("tab20").colors  # strong colours first, then their light pairs: 20 distinct
    colors = tab20[0::2] + tab20[1::2]
    fig, ax = plt.subplots(figsize=(9.5, 5.2), dpi=85)
    others = 0
    for label in labels:
        a = aggs[label]
        if label == DENSE:
            style, kw = "-", {"color": "black", "linewidth": 2.2, "zorder": 3}
        else:
            style = family_style.get(re.split(r"[:+,]", label)[0], "-")
            kw = {"color": colors[others % len(colors)], "linewidth": 1.3}
            others += 1
        ax.plot(a["cum"], [100 * x for x in a["acc"]], linestyle=style, label=label, **kw)
    if dense_final is not None:
        ax.axhline(100 * dense_final - TARGET_POINTS, color="grey", linewidth=0.8, linestyle="--")
        ax.axhline(100 * dense_final - BTT_POINTS, color="grey", linewidth=0.8, linestyle=":")
        from matplotlib.transforms import blended_transform_factory
        where = blended_transform_factory(ax.transAxes, ax.transData)
        ax.text(0.005, 100 * dense_final - TARGET_POINTS, "dense − 0.5", va="bottom", fontsize=7, color="grey",
                transform=where)
        ax.text(0.005, 100 * dense_final - BTT_POINTS, "dense − 1", va="top", fontsize=7, color="grey",
                transform=where)
    ax.set_xscale("log")
    ax.set_xlabel("cumulative bytes sent (uplink updates on the wire, mean over seeds)")
    ax.set_ylabel("test accuracy % (mean over seeds)")
    ax.set_title("fedmesh sim: 8 sites, Dirichlet 0.5, mlp, error-feedback compression", fontsize=10)
    if dense_final is not None:  # the region that matters: from 20 points below dense to just above it
        ax.set_ylim(100 * dense_final - 20, 100 * dense_final + 2)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    try:  # a 256-colour palette keeps the committed copy small (~50 KB instead of ~110 KB)
        from PIL import Image
        with Image.open(path) as image:
            small = image.convert("RGB").quantize(colors=256)
        small.save(path, optimize=True)
    except ImportError:
        pass


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", default="bench/results/compression", help="results directory")
    p.add_argument("--copy-png", metavar="PATH", help="also write the plot here")
    args = p.parse_args()
    out = Path(args.out)
    labels, flags, runs = load(out)
    if not labels:
        print(f"plot_compression.py: no finished runs (*__seed*.jsonl) in {out}", file=sys.stderr)
        return 1
    aggs = {l: aggregate(runs[l]) for l in labels}
    config = (out / "config.txt").read_text().strip() if (out / "config.txt").exists() else None
    text, _ = table(labels, flags, aggs)
    if config:
        text = f"Command per run: `{config}` plus the setting's flags.\n\n" + text
    sys.stdout.write(text)
    (out / "table.md").write_text(text)
    print(f"plot_compression.py: wrote {out / 'table.md'}", file=sys.stderr)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_compression.py: matplotlib is missing, so no plot was written. Install it with\n"
              "  apt-get install -y python3-matplotlib   (Debian/Ubuntu; then run /usr/bin/python3)\n"
              "or python3 -m pip install matplotlib", file=sys.stderr)
        return 3
    png = out / "accuracy_vs_bytes.png"
    dense = aggs.get(DENSE)
    plot(labels, aggs, png, dense["final_mean"] if dense else None)
    print(f"plot_compression.py: wrote {png}", file=sys.stderr)
    if args.copy_png:
        shutil.copyfile(png, args.copy_png)
        print(f"plot_compression.py: copied to {args.copy_png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
