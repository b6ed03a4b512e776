#!/usr/bin/env python3
"""Reads the logs of deploy/gpu_kit.sh run and says what they hold.

  gpu_kit_report.py train DIR        the GPU-vs-CPU training table of DIR/*.jsonl;
                                     exit 1 if a GPU run failed or disagrees
  gpu_kit_report.py federation LOG   the GPU and CPU federations' last test
                                     accuracies; exit 1 unless both finished
                                     all their rounds within 1 point
  gpu_kit_report.py kernels CSV       the kernels of an Nsight Compute raw CSV
                                     (gpu__time_duration.sum) summed by name
  gpu_kit_report.py report LOG       LOG/report.json: every step's exit code and
                                     time, the device, the tests, the sanitizer,
                                     training, federation and throughput results

Python's standard library only (it runs on the GPU machine's python3).
"""
import glob
import json
import os
import re
import sys

# How far the GPU may be from the CPU run of the same seed and steps. Image
# models: test accuracy in points (reductions run in another order, so the
# runs drift apart step by step, more in half precision). Language models:
# held-out loss in nats.
ACCURACY_POINTS = {"fp32": 1.5, "bf16": 3.0, "fp16": 3.0}
LOSS_NATS = {"fp32": 0.05, "bf16": 0.15, "fp16": 0.15}
FEDERATION_POINTS = 1.0


def last_summary(text):
    """The last {"event":"summary"} line of JSON lines, or None."""
    summaries = [event for event in json_lines(text) if event.get("event") == "summary"]
    return summaries[-1] if summaries else None


def train_table(directory):
    """Rows of (model, precision) with the CPU and GPU summaries side by side."""
    rows = []
    runs = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.jsonl"))):
        name = os.path.basename(path)[: -len(".jsonl")]
        model_precision, device = name.rsplit("-", 1)
        model, precision = model_precision.rsplit("-", 1)
        runs.setdefault((model, precision), {})[device] = last_summary(read(path))
    for (model, precision), by_device in sorted(runs.items()):
        cpu, gpu = by_device.get("cpu"), by_device.get("cuda")
        row = {"model": model, "precision": precision}
        for device, summary in (("cpu", cpu), ("cuda", gpu)):
            if summary:
                row[device] = {key: summary.get(key) for key in
                               ("test_accuracy", "test_loss", "train_loss", "samples_per_second", "steps",
                                "skipped_steps")}
            else:
                row[device] = None
        language = model.startswith("gpt")
        if cpu and gpu:
            if language:
                row["loss_difference"] = gpu["test_loss"] - cpu["test_loss"]
                row["agrees"] = abs(row["loss_difference"]) <= LOSS_NATS[precision]
            else:
                row["accuracy_points"] = 100.0 * (gpu["test_accuracy"] - cpu["test_accuracy"])
                row["agrees"] = abs(row["accuracy_points"]) <= ACCURACY_POINTS[precision]
        elif gpu:
            # The CPU may refuse a precision (fp16): the GPU run still counts
            # if it learned at all.
            row["agrees"] = None
        else:
            row["agrees"] = False
        rows.append(row)
    return rows


def print_train(rows):
    print(f"{'model':<9} {'prec':<5} {'cpu acc':>8} {'gpu acc':>8} {'cpu loss':>9} {'gpu loss':>9} "
          f"{'cpu sps':>9} {'gpu sps':>10}  verdict")

    def cell(row, device, key, fmt):
        value = (row.get(device) or {}).get(key)
        return format(value, fmt) if isinstance(value, (int, float)) else "n/a"

    for row in rows:
        verdict = {True: "agree", False: "DISAGREE", None: "gpu only"}[row["agrees"]]
        if "accuracy_points" in row:
            verdict += f" ({row['accuracy_points']:+.2f} points)"
        if "loss_difference" in row:
            verdict += f" ({row['loss_difference']:+.4f} nats)"
        print(f"{row['model']:<9} {row['precision']:<5} {cell(row, 'cpu', 'test_accuracy', '8.4f'):>8} "
              f"{cell(row, 'cuda', 'test_accuracy', '8.4f'):>8} {cell(row, 'cpu', 'test_loss', '9.4f'):>9} "
              f"{cell(row, 'cuda', 'test_loss', '9.4f'):>9} {cell(row, 'cpu', 'samples_per_second', '9.0f'):>9} "
              f"{cell(row, 'cuda', 'samples_per_second', '10.0f'):>10}  {verdict}")


ROUND = re.compile(r"^round (\d+) -> version (\d+): (\d+) updates\s+test accuracy ([0-9.]+)%")


def federation_result(log_dir, device):
    path = os.path.join(log_dir, f"federation-{device}", "aggregator.log")
    rounds = []
    try:
        with open(path, errors="replace") as f:
            for line in f:
                match = ROUND.match(line)
                if match:
                    rounds.append({"round": int(match.group(1)), "updates": int(match.group(3)),
                                   "test_accuracy": float(match.group(4)) / 100.0})
    except OSError:
        return None
    expected = None
    try:
        with open(os.path.join(log_dir, f"federation-{device}", "agg.toml")) as f:
            for line in f:
                if line.startswith("rounds ="):
                    expected = int(line.split("=")[1])
    except OSError:
        pass
    return {"rounds": rounds, "rounds_expected": expected,
            "final_accuracy": rounds[-1]["test_accuracy"] if rounds else None}


def federation(log_dir):
    results = {device: federation_result(log_dir, device) for device in ("cuda", "cpu")}
    ok = True
    for device, result in results.items():
        if not result or result["final_accuracy"] is None:
            print(f"federation on {device}: no round finished")
            ok = False
            continue
        finished = len(result["rounds"])
        print(f"federation on {device}: {finished}/{result['rounds_expected']} rounds, "
              f"last test accuracy {100 * result['final_accuracy']:.2f}%")
        if result["rounds_expected"] and finished < result["rounds_expected"]:
            ok = False
    if ok:
        gap = 100.0 * (results["cuda"]["final_accuracy"] - results["cpu"]["final_accuracy"])
        results["points"] = gap
        results["agrees"] = abs(gap) <= FEDERATION_POINTS
        print(f"GPU - CPU: {gap:+.2f} points ({'within' if results['agrees'] else 'NOT within'} "
              f"{FEDERATION_POINTS} point)")
        ok = results["agrees"]
    return results, ok


def kernel_times(path):
    """{kernel name: [launches, nanoseconds]} from `ncu --import R --csv --page raw`."""
    import csv
    totals = {}
    with open(path, newline="", errors="replace") as f:
        rows = list(csv.reader(f))
    header = next((i for i, row in enumerate(rows) if "Kernel Name" in row), None)
    if header is None:
        raise ValueError(f"{path}: no 'Kernel Name' column")
    columns = rows[header]
    name_column = columns.index("Kernel Name")
    time_column = next(i for i, c in enumerate(columns) if c.startswith("gpu__time_duration"))
    scale = 1.0
    for row in rows[header + 1:]:
        if len(row) <= max(name_column, time_column):
            continue
        value = row[time_column].replace(",", "")
        try:
            duration = float(value)
        except ValueError:
            # The units row ("ns", "usecond", "msecond") under the header.
            unit = value.lower()
            scale = {"ns": 1.0, "nsecond": 1.0, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6}.get(unit, scale)
            continue
        name = row[name_column]
        entry = totals.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += duration * scale
    return totals


def print_kernels(totals, top=30):
    total = sum(ns for _, ns in totals.values())
    launches = sum(count for count, _ in totals.values())
    print(f"{launches} kernel launches, {total / 1e6:.2f} ms of device time in all")
    print(f"{'ms':>9} {'share':>6} {'launches':>8}  kernel")
    for name, (count, ns) in sorted(totals.items(), key=lambda item: -item[1][1])[:top]:
        print(f"{ns / 1e6:9.3f} {100 * ns / total:5.1f}% {count:8d}  {name[:140]}")


def read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def json_lines(text):
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def report(log_dir):
    result = {"steps": []}
    for line in read(os.path.join(log_dir, "summary.txt")).splitlines():
        match = re.match(r"^(\S+)\s+exit (\d+)\s+(\d+)s", line)
        if match:
            result["steps"].append({"step": match.group(1), "exit": int(match.group(2)),
                                    "seconds": int(match.group(3))})
    doctor = read(os.path.join(log_dir, "doctor.log"))
    gpus = [line for line in doctor.splitlines() if "," in line and not line.startswith(("{", "name"))]
    result["gpu"] = gpus[0] if gpus else None
    doctor_json = json_lines(doctor)
    result["doctor"] = doctor_json[-1] if doctor_json else None
    tests = read(os.path.join(log_dir, "tests.log"))
    result["tests"] = re.findall(r"^(test_\w+: .*)$", tests, re.M)
    result["tests_failed"] = re.findall(r"^\[  FAILED  \] (\S+)", tests, re.M)
    result["sanitize"] = re.findall(r"^RESULT (.*)$", read(os.path.join(log_dir, "sanitize.log")), re.M)
    if os.path.isdir(os.path.join(log_dir, "train")):
        result["train"] = train_table(os.path.join(log_dir, "train"))
    if os.path.isdir(os.path.join(log_dir, "federation-cuda")):
        result["federation"] = {device: federation_result(log_dir, device) for device in ("cuda", "cpu")}
    throughput = [r for r in json_lines(read(os.path.join(log_dir, "throughput.log")))
                  if r.get("benchmark") == "fedmesh_vs_pytorch"]
    result["throughput"] = [{key: r.get(key) for key in
                             ("model", "precision", "batch_size", "device_name", "fedmesh_samples_per_second",
                              "pytorch_samples_per_second", "ratio", "fedmesh_test_accuracy",
                              "pytorch_test_accuracy", "errors")} for r in throughput]
    result["profile"] = last_summary(read(os.path.join(log_dir, "profile.log")))
    with open(os.path.join(log_dir, "report.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"report: {os.path.join(log_dir, 'report.json')}")
    return True


def main(argv):
    if len(argv) != 3 or argv[1] not in ("train", "federation", "kernels", "report"):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[1] == "train":
        rows = train_table(argv[2])
        print_train(rows)
        return 0 if rows and all(row["agrees"] is not False for row in rows) else 1
    if argv[1] == "kernels":
        totals = kernel_times(argv[2])
        print_kernels(totals)
        return 0 if totals else 1
    if argv[1] == "federation":
        _, ok = federation(argv[2])
        return 0 if ok else 1
    return 0 if report(argv[2]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
