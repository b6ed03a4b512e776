#!/usr/bin/env python3
"""Writes the seeds of fuzz_tokenizer (corpus/tokenizer/): a valid BPE
tokenizer file as `fedmesh tokenizer train` writes it, and one file per
refusal the parser names (train/data/bpe_tokenizer.h)."""
import json
import os
import struct

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "tokenizer")


def fingerprint(merges, max_piece_bytes=128, pretokenizer="gpt2-ascii"):
    h = 0xcbf29ce484222325
    data = pretokenizer.encode() + b"\0" + struct.pack("<I", max_piece_bytes)
    for a, b in merges:
        data += struct.pack("<II", a & 0xffffffff, b & 0xffffffff)
    for byte in data:
        h ^= byte
        h = (h * 0x100000001b3) & 0xffffffffffffffff
    return "fnv1a64:%016x" % h


def tokenizer_file(merges, **changes):
    file = {"format": "fedmesh-bpe", "version": 1, "pretokenizer": "gpt2-ascii", "max_piece_bytes": 128,
            "vocab_size": 256 + len(merges), "checksum": None, "merges": merges}
    file.update(changes)
    if file["checksum"] is None:
        file["checksum"] = fingerprint(merges)
    return json.dumps(file, indent=2) + "\n"


def main():
    os.makedirs(HERE, exist_ok=True)
    # " the", " and", "th" ...: a few merges of English.
    good = [[116, 104], [32, 256], [257, 101], [97, 110], [32, 259], [260, 100], [32, 97], [105, 110]]
    seeds = {
        "valid": tokenizer_file(good),
        "valid_no_merges": tokenizer_file([]),
        "truncated": tokenizer_file(good)[:150],
        "version_2": tokenizer_file(good, version=2),
        "later_id": tokenizer_file([[116, 104], [300, 101]], checksum=fingerprint([[116, 104], [300, 101]])),
        "negative_id": tokenizer_file([[116, -1]], checksum=fingerprint([[116, -1]])),
        "duplicate": tokenizer_file([[116, 104], [116, 104]], checksum=fingerprint([[116, 104], [116, 104]])),
        "vocab_over_limit": tokenizer_file(good, vocab_size=70000),
        "vocab_mismatch": tokenizer_file(good, vocab_size=300),
        "bad_checksum": tokenizer_file(good, checksum="fnv1a64:0000000000000000"),
        "not_a_pair": tokenizer_file([[116, 104, 101]], checksum=fingerprint([])),
        "unknown_key": tokenizer_file(good, comment="x"),
        "too_long_token": tokenizer_file([[97, 97]] + [[256 + i, 256 + i] for i in range(8)],
                                         checksum=fingerprint([[97, 97]] + [[256 + i, 256 + i] for i in range(8)])),
        "piece_bytes_4": tokenizer_file([[116, 104]], max_piece_bytes=4,
                                        checksum=fingerprint([[116, 104]], max_piece_bytes=4)),
    }
    for name, text in seeds.items():
        with open(os.path.join(HERE, name), "w") as out:
            out.write(text)


if __name__ == "__main__":
    main()
