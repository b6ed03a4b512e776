#!/usr/bin/env python3
"""Writes the diabetes regression table that Debian's python3-sklearn ships
(442 patients, 10 measurements, the disease's progression a year later) as
CSV files with a header row: a held-out test table and one table per site,
the sites split by age (site 0 the youngest), so their targets differ in
distribution. Deterministic (a fixed seed).

usage: split_diabetes.py OUT_DIR [--sites 3] [--baseline] [--npz]
writes OUT_DIR/test.csv, OUT_DIR/site-0.csv ..., OUT_DIR/all-train.csv
(--npz: also all-train.npz and test.npz, x float32 and y float64, for arrays:FILE)
"""
import argparse
import csv
import gzip
import os
import random

DATA = "/usr/lib/python3/dist-packages/sklearn/datasets/data/diabetes_data_raw.csv.gz"
TARGET = "/usr/lib/python3/dist-packages/sklearn/datasets/data/diabetes_target.csv.gz"
# sex is coded 1 or 2, as the source has it.
HEADER = ["age", "sex", "bmi", "bp", "s1", "s2", "s3", "s4", "s5", "s6", "progression"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--sites", type=int, default=3)
    parser.add_argument("--npz", action="store_true", help="also write all-train.npz and test.npz (x, y)")
    parser.add_argument("--baseline", action="store_true",
                        help="also print the test R² and MAE of scikit-learn's linear regression trained centrally "
                             "on all the sites' rows")
    args = parser.parse_args()
    with gzip.open(DATA, "rt") as f:
        data = [line.split() for line in f if line.strip()]
    with gzip.open(TARGET, "rt") as f:
        target = [float(line) for line in f if line.strip()]
    assert len(data) == len(target) == 442 and all(len(r) == 10 for r in data), "unexpected diabetes files"
    records = [(r, f"{t:g}") for r, t in zip(data, target)]
    rng = random.Random(11)
    rng.shuffle(records)
    test_size = len(records) // 5
    test, train = records[:test_size], records[test_size:]
    os.makedirs(args.out, exist_ok=True)

    def write(name, part):
        with open(os.path.join(args.out, name), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(HEADER)
            for values, y in part:
                w.writerow(values + [y])

    write("test.csv", test)
    write("all-train.csv", train)
    by_age = sorted(train, key=lambda record: float(record[0][0]))
    for i in range(args.sites):
        shard = by_age[i * len(by_age) // args.sites:(i + 1) * len(by_age) // args.sites]
        write(f"site-{i}.csv", shard)
        ages = [float(values[0]) for values, _ in shard]
        mean = sum(float(y) for _, y in shard) / len(shard)
        print(f"site-{i}.csv: {len(shard)} rows, ages {min(ages):g}-{max(ages):g}, mean progression {mean:.1f}")
    print(f"test.csv: {len(test)} rows; all-train.csv: {len(train)} rows")
    if args.npz:
        import numpy as np
        for name, part in (("all-train.npz", train), ("test.npz", test)):
            x = np.array([[float(v) for v in values] for values, _ in part], dtype=np.float32)
            y = np.array([float(t) for _, t in part], dtype=np.float64)
            np.savez_compressed(os.path.join(args.out, name), x=x, y=y)
    if args.baseline:
        import numpy as np
        from sklearn.linear_model import LinearRegression

        def matrix(part):
            return np.array([[float(x) for x in v] for v, _ in part])
        y = np.array([float(t) for _, t in train])
        ty = np.array([float(t) for _, t in test])
        model = LinearRegression().fit(matrix(train), y)
        predicted = model.predict(matrix(test))
        mae = float(np.mean(np.abs(predicted - ty)))
        print(f"central linear regression test R2: {model.score(matrix(test), ty):.4f} MAE: {mae:.2f}")


if __name__ == "__main__":
    main()
