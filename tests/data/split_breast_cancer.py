#!/usr/bin/env python3
"""Writes the Wisconsin breast-cancer table that Debian's python3-sklearn ships
as CSV files with a header row: a held-out test table and one table per site,
the sites given different class balances (site i takes malignant rows with
weight MALIGNANT_SHARE[i]). Deterministic (a fixed seed).

usage: split_breast_cancer.py OUT_DIR [--sites 3]
writes OUT_DIR/test.csv, OUT_DIR/site-0.csv ..., OUT_DIR/all-train.csv
"""
import argparse
import csv
import os
import random

SOURCE = "/usr/lib/python3/dist-packages/sklearn/datasets/data/breast_cancer.csv"
FEATURES = [
    "mean radius", "mean texture", "mean perimeter", "mean area", "mean smoothness", "mean compactness",
    "mean concavity", "mean concave points", "mean symmetry", "mean fractal dimension",
    "radius error", "texture error", "perimeter error", "area error", "smoothness error", "compactness error",
    "concavity error", "concave points error", "symmetry error", "fractal dimension error",
    "worst radius", "worst texture", "worst perimeter", "worst area", "worst smoothness", "worst compactness",
    "worst concavity", "worst concave points", "worst symmetry", "worst fractal dimension",
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--sites", type=int, default=3)
    parser.add_argument("--source", default=SOURCE)
    parser.add_argument("--baseline", action="store_true",
                        help="also print the test accuracy of scikit-learn's logistic regression trained centrally "
                             "on all the sites' rows (standardized)")
    args = parser.parse_args()
    with open(args.source, newline="") as f:
        rows = list(csv.reader(f))
    count, features, *class_names = rows[0]
    assert int(features) == len(FEATURES), "unexpected column count"
    records = [(r[:-1], class_names[int(r[-1])]) for r in rows[1:]]
    assert len(records) == int(count)
    rng = random.Random(7)
    rng.shuffle(records)
    test_size = len(records) // 5
    test, train = records[:test_size], records[test_size:]
    os.makedirs(args.out, exist_ok=True)
    header = FEATURES + ["diagnosis"]

    def write(name, part):
        with open(os.path.join(args.out, name), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(header)
            for values, label in part:
                w.writerow(values + [label])

    write("test.csv", test)
    write("all-train.csv", train)
    # Different class balances: malignant rows go to the sites with weights
    # that differ from benign ones.
    malignant_weights = [1 + 2 * i for i in range(args.sites)]
    benign_weights = list(reversed(malignant_weights))
    shards = [[] for _ in range(args.sites)]
    for values, label in train:
        weights = malignant_weights if label == "malignant" else benign_weights
        site = rng.choices(range(args.sites), weights=weights)[0]
        shards[site].append((values, label))
    for i, shard in enumerate(shards):
        write(f"site-{i}.csv", shard)
        malignant = sum(1 for _, label in shard if label == "malignant")
        print(f"site-{i}.csv: {len(shard)} rows, {malignant} malignant")
    print(f"test.csv: {len(test)} rows; all-train.csv: {len(train)} rows")
    if args.baseline:
        import numpy as np
        from sklearn.linear_model import LogisticRegression
        from sklearn.preprocessing import StandardScaler
        x = np.array([[float(v) for v in values] for values, _ in train])
        y = np.array([label for _, label in train])
        tx = np.array([[float(v) for v in values] for values, _ in test])
        ty = np.array([label for _, label in test])
        scaler = StandardScaler().fit(x)
        model = LogisticRegression(max_iter=1000).fit(scaler.transform(x), y)
        print(f"central logistic regression test accuracy: {model.score(scaler.transform(tx), ty):.4f}")


if __name__ == "__main__":
    main()
