#!/usr/bin/env python3
"""Writes the seeds of fuzz_specs (tests/fuzz/corpus/specs/): one valid spec
of every form each parser accepts, and a few it must refuse. Byte 0 picks the
parser, byte 1 is the small parameter (fuzz_specs.cpp's header)."""
import pathlib

PARTITION, COMPRESSION, OVERRIDE, PLAN, FAULTS, STALENESS, TOPOLOGY = range(7)

SEEDS = {
    "partition_iid": (PARTITION, 4, "iid"),
    "partition_dirichlet": (PARTITION, 8, "dirichlet:0.5"),
    "partition_shards": (PARTITION, 5, "shards:2"),
    "partition_bad_alpha": (PARTITION, 3, "dirichlet:-1"),
    "compression_topk": (COMPRESSION, 0, "topk:0.01+int8"),
    "compression_int4": (COMPRESSION, 0, "int4:stochastic"),
    "compression_powersgd": (COMPRESSION, 0, "powersgd:4"),
    "compression_dct": (COMPRESSION, 0, "dct-sign:32"),
    "compression_bf16": (COMPRESSION, 0, "bf16"),
    # Found by fuzz_specs: to_string wrote 10 digits ("topk:0.0995+fp16"),
    # which parse back to another density.
    "compression_density_round_trip": (COMPRESSION, 0, "topk:0.09949999999999"),
    "override_bias": (OVERRIDE, 0, "*.bias=identity"),
    "plan": (PLAN, 64, "topk:0.01;*.bias=fp16;layer0.*=int8"),
    "faults": (FAULTS, 0, "drop=0.2,delay=50ms,jitter=10ms,bandwidth=1MB/s,seed=7"),
    "faults_none": (FAULTS, 0, "none"),
    "staleness_polynomial": (STALENESS, 0, "polynomial:0.5"),
    "staleness_hinge": (STALENESS, 11, "hinge:10:4"),
    "staleness_inverse": (STALENESS, 3, "inverse"),
    "topology_random": (TOPOLOGY, 9, "random"),
    "topology_exponential": (TOPOLOGY, 17, "one-peer-exponential"),
}

def main():
    out = pathlib.Path(__file__).resolve().parent / "corpus" / "specs"
    out.mkdir(parents=True, exist_ok=True)
    for name, (parser, parameter, text) in SEEDS.items():
        (out / name).write_bytes(bytes([parser, parameter]) + text.encode())

if __name__ == "__main__":
    main()
