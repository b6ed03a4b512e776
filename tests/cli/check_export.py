#!/usr/bin/env python3
"""Reads a fedmesh safetensors export and the matching .npy directory with
NumPy alone (no fedmesh code, no pickle) and checks that they hold the same
tensors with the same values.

usage: check_export.py MODEL.safetensors NPY_DIR
"""
import json
import pathlib
import struct
import sys

import numpy as np

DTYPES = {"F32": np.float32, "F16": np.float16}


def read_safetensors(path):
    data = pathlib.Path(path).read_bytes()
    (header_length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_length])
    body = data[8 + header_length :]
    tensors = {}
    end_of_previous = 0
    for name, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0] if kv[0] != "__metadata__" else -1):
        if name == "__metadata__":
            assert all(isinstance(v, str) for v in entry.values()), "metadata values must be strings"
            continue
        begin, end = entry["data_offsets"]
        assert begin == end_of_previous, f"{name}: hole or overlap before offset {begin}"
        end_of_previous = end
        array = np.frombuffer(body[begin:end], dtype=DTYPES[entry["dtype"]]).reshape(entry["shape"])
        tensors[name] = array
    assert end_of_previous == len(body), "bytes after the last tensor"
    return tensors


def main():
    safetensors, npy_dir = sys.argv[1], pathlib.Path(sys.argv[2])
    tensors = read_safetensors(safetensors)
    for name, array in tensors.items():
        loaded = np.load(npy_dir / f"{name}.npy", allow_pickle=False)
        assert loaded.shape == array.shape, f"{name}: shape {loaded.shape} != {array.shape}"
        assert loaded.dtype == array.dtype, f"{name}: dtype {loaded.dtype} != {array.dtype}"
        assert np.array_equal(loaded, array), f"{name}: values differ"
        assert np.all(np.isfinite(array)), f"{name}: non-finite values"
    print(f"{len(tensors)} tensors agree")


if __name__ == "__main__":
    main()
