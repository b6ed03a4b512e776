#!/usr/bin/env python3
"""Writes scikit-learn's 8x8 digits (1797 images) as PNG class folders for
`--data images:OUT/train` (with OUT/test as its test folder):

    OUT/train/<digit>/NNNN.png   (80 %)
    OUT/test/<digit>/NNNN.png    (20 %: every fifth image of each digit)

NNNN is the row of the image in digits.csv.gz. Pixels 0..16 are scaled to
0..255 (v * 255 // 16). Grayscale PNGs by default, RGB with --rgb (gray
replicated). Needs python3 and numpy only: the PNGs are written with zlib
and struct, the data read from the copy scikit-learn ships (python3-sklearn).

    python3 tests/data/make_digits_images.py /tmp/digits [--rgb] [--sites N]
"""
import argparse
import gzip
import os
import struct
import sys
import zlib

import numpy as np

DEFAULT_CSV = "/usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz"
TEST_EVERY = 5  # the fixed split: the 5th, 10th, ... image of each digit is a test image


def png_bytes(pixels: np.ndarray) -> bytes:
    """pixels: (rows, cols) or (rows, cols, 3) uint8."""
    rows, cols = pixels.shape[:2]
    color_type = 2 if pixels.ndim == 3 else 0
    raw = b"".join(b"\x00" + pixels[r].tobytes() for r in range(rows))  # filter 0 on every row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", cols, rows, 8, color_type, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) +
            chunk(b"IEND", b""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="output folder (train/ and test/ are made in it)")
    parser.add_argument("--rgb", action="store_true", help="write RGB PNGs instead of grayscale")
    parser.add_argument("--csv", default=DEFAULT_CSV, help="digits.csv.gz (default: scikit-learn's copy)")
    parser.add_argument("--npz", action="store_true",
                        help="also write OUT/train.npz and OUT/test.npz (np.savez_compressed: x uint8 (N, 1, 8, 8), "
                             "y int64) for --data arrays:FILE")
    parser.add_argument("--sites", type=int, default=0,
                        help="also deal the training images round robin into OUT/site-0 ... OUT/site-(N-1), "
                             "one folder per site for a federation")
    args = parser.parse_args()

    if not os.path.exists(args.csv):
        print(f"make_digits_images: {args.csv}: not found (Debian: apt-get install python3-sklearn)", file=sys.stderr)
        return 1
    with gzip.open(args.csv, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.int64)
    if table.ndim != 2 or table.shape[1] != 65:
        print(f"make_digits_images: {args.csv}: expected rows of 64 pixels and a label, got {table.shape}",
              file=sys.stderr)
        return 1
    pixels, labels = table[:, :64], table[:, 64]
    if pixels.min() < 0 or pixels.max() > 16 or labels.min() < 0 or labels.max() > 9:
        print(f"make_digits_images: {args.csv}: values outside 0..16 or labels outside 0..9", file=sys.stderr)
        return 1

    seen = {}
    counts = {"train": 0, "test": 0}
    arrays = {"train": ([], []), "test": ([], [])}
    for row, (values, label) in enumerate(zip(pixels, labels)):
        image = (values * 255 // 16).astype(np.uint8).reshape(8, 8)
        if args.rgb:
            image = np.repeat(image[:, :, None], 3, axis=2)
        seen[label] = seen.get(label, 0) + 1
        split = "test" if seen[label] % TEST_EVERY == 0 else "train"
        folders = [os.path.join(args.out, split, str(label))]
        if split == "train" and args.sites > 0:
            folders.append(os.path.join(args.out, f"site-{counts['train'] % args.sites}", str(label)))
        for folder in folders:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"{row:04d}.png"), "wb") as f:
                f.write(png_bytes(image))
        counts[split] += 1
        arrays[split][0].append((values * 255 // 16).astype(np.uint8).reshape(1, 8, 8))
        arrays[split][1].append(int(label))
    if args.npz:
        for split, (xs, ys) in arrays.items():
            np.savez_compressed(os.path.join(args.out, f"{split}.npz"), x=np.stack(xs), y=np.array(ys, dtype=np.int64))
    print(f"make_digits_images: {counts['train']} train and {counts['test']} test images "
          f"({'RGB' if args.rgb else 'gray'} 8x8 PNG) in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
