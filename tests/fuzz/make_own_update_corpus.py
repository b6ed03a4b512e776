#!/usr/bin/env python3
"""Writes the seed corpus of fuzz_own_update (tests/fuzz/corpus/own_update/).

Own updates of round 4 of the target's model (tensor 0 {64}, tensor 1 {7, 9})
in the store's two formats (node/own_update_bytes.h): format 2, each tensor
dense-f32 in one or two segments; format 1, a few coordinates. Run from the
repository root:
    python3 tests/fuzz/make_own_update_corpus.py
"""
import os
import struct

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests", "fuzz", "corpus", "own_update")
DENSE_F32 = 0
SPARSE_F32 = 3


def segment(tensor, encoding, offset, count, nnz, indices, values):
    return (struct.pack("<IIQQQII", tensor, encoding, offset, count, nnz, 0, 0) +
            struct.pack("<QQQ", len(indices), len(values), 0) + indices + values)


def dense(tensor, offset, count, start):
    return segment(tensor, DENSE_F32, offset, count, 0, b"",
                   struct.pack("<%df" % count, *[start + 0.25 * i for i in range(count)]))


def format2(tensors):
    out = b"FMRO" + struct.pack("<IQQ", 2, 4, len(tensors))
    for encoding, segments in tensors:
        out += struct.pack("<IIQ", encoding, 0, len(segments)) + b"".join(segments)
    return out


def main():
    os.makedirs(OUT, exist_ok=True)
    seeds = {
        "dense_whole": format2([(DENSE_F32, [dense(0, 0, 64, -8.0)]), (DENSE_F32, [dense(1, 0, 63, 1.0)])]),
        "dense_split": format2([(DENSE_F32, [dense(0, 0, 32, 0.5), dense(0, 32, 32, -0.5)]),
                                (DENSE_F32, [dense(1, 0, 63, 2.0)])]),
        "format1": b"FMRO" + struct.pack("<IQQ", 1, 4, 3) + struct.pack("<3Q", 1, 70, 126) +
                   struct.pack("<3f", 0.5, -1.0, 2.0),
    }
    for name, data in seeds.items():
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(data)
    print("wrote %d seeds to %s" % (len(seeds), OUT))


if __name__ == "__main__":
    main()
