#!/usr/bin/env python3
"""Writes the seed corpus of fuzz_codec (tests/fuzz/corpus/codec/).

The input layout is documented at the top of tests/fuzz/fuzz_codec.cpp: a
flags byte, the encoding byte, seven LEB128 varints (tensor, offset, count,
nnz, block_size, indices length, values length), then indices, values and
scales. Run from the repository root: python3 tests/fuzz/make_codec_corpus.py
"""
import os
import struct

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "codec")

(DENSE_F32, DENSE_BF16, DENSE_F16, SPARSE_F32, SPARSE_F16, SPARSE_INT8, BLOCK_INT8, BLOCK_INT4,
 BITMAP_F32, BITMAP_F16, BITMAP_INT8, DCT_SIGN) = range(12)
# flags: bits 0-1 shape (0: {64}, 1: {7, 9}, 2: scalar, 3: {2500}); bits 2-4 weight index
SHAPE_64, SHAPE_7x9, SHAPE_SCALAR, SHAPE_2500 = 0, 1, 2, 3
WEIGHT_HALF, WEIGHT_MINUS_2 = 1 << 2, 2 << 2


def varint(value):
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def seed(flags, encoding, tensor=0, offset=0, count=0, nnz=0, block_size=0, indices=b"", values=b"", scales=b""):
    header = bytes([flags, encoding])
    for field in (tensor, offset, count, nnz, block_size, len(indices), len(values)):
        header += varint(field)
    return header + indices + values + scales


def f32(*xs):
    return struct.pack("<%df" % len(xs), *xs)


def f16(*xs):
    return struct.pack("<%de" % len(xs), *xs)


def bf16(*xs):
    return b"".join(struct.pack("<I", struct.unpack("<I", struct.pack("<f", x))[0])[2:] for x in xs)


def gaps(offset, indices):
    out, previous = b"", offset
    for i in indices:
        out += varint(i - previous)
        previous = i
    return out


def bitmap(count, indices):
    out = bytearray((count + 7) // 8)
    for i in indices:
        out[i // 8] |= 1 << (i % 8)
    return bytes(out)


def signs(*negative):
    out = bytearray((len(negative) + 7) // 8)
    for k, n in enumerate(negative):
        out[k // 8] |= (1 if n else 0) << (k % 8)
    return bytes(out)


def int4(*qs):
    out = bytearray((len(qs) + 1) // 2)
    for i, q in enumerate(qs):
        out[i // 2] |= (q & 0xF) << (4 * (i & 1))
    return bytes(out)


SEEDS = {
    # valid
    "dense_f32_64": seed(SHAPE_64, DENSE_F32, count=64, values=f32(*[i * 0.25 - 8 for i in range(64)])),
    "dense_f32_tail_7x9": seed(SHAPE_7x9 | WEIGHT_MINUS_2, DENSE_F32, offset=60, count=3, values=f32(1.5, -2.5, 3.0)),
    "dense_f32_scalar": seed(SHAPE_SCALAR, DENSE_F32, count=1, values=f32(42.0)),
    "dense_bf16": seed(SHAPE_64 | WEIGHT_HALF, DENSE_BF16, offset=10, count=5, values=bf16(1, -2, 0.5, 1e30, -1e-30)),
    "dense_f16": seed(SHAPE_7x9, DENSE_F16, count=4, values=f16(1.0, -65504.0, 0.000061035, 3.14)),
    "sparse_f32": seed(SHAPE_2500, SPARSE_F32, offset=100, count=900, nnz=3,
                       indices=gaps(100, [100, 400, 999]), values=f32(1.0, -2.0, 3.5)),
    "sparse_f16_wide_gap": seed(SHAPE_2500 | WEIGHT_HALF, SPARSE_F16, count=1000, nnz=2,
                                indices=gaps(0, [3, 998]), values=f16(0.5, -0.25)),
    "sparse_int8": seed(SHAPE_64, SPARSE_INT8, count=64, nnz=4, indices=gaps(0, [0, 1, 2, 63]),
                        values=bytes([127, 0x81, 5, 0]), scales=f32(0.01)),
    "block_int8": seed(SHAPE_64, BLOCK_INT8, count=20, block_size=8, values=bytes(range(20)),
                       scales=f32(0.5, 0.25, 0.0)),
    "block_int4_odd": seed(SHAPE_7x9 | WEIGHT_MINUS_2, BLOCK_INT4, offset=56, count=7, block_size=3,
                           values=int4(-7, 7, 0, 1, -1, 3, 2), scales=f32(1.0, 0.5, 2.0)),
    # int4 blocks of odd size longer than the decoder's 1024-element chunk
    "block_int4_long": seed(SHAPE_2500, BLOCK_INT4, offset=300, count=2101, block_size=1025,
                            values=int4(*[(i % 15) - 7 for i in range(2101)]), scales=f32(0.125, 3.0, 1e-3)),
    "bitmap_f32": seed(SHAPE_64, BITMAP_F32, offset=8, count=50, nnz=3, indices=bitmap(50, [0, 9, 49]),
                       values=f32(1.0, -2.0, 0.5)),
    "bitmap_int8": seed(SHAPE_2500 | WEIGHT_HALF, BITMAP_INT8, count=2500, nnz=2, indices=bitmap(2500, [7, 2499]),
                        values=bytes([127, 0x81]), scales=f32(0.5)),
    # dct-sign: one 4096-coefficient chunk covering the whole 2500-element tensor (padded)
    "dct_sign": seed(SHAPE_2500, DCT_SIGN, count=2500, nnz=4, indices=gaps(0, [0, 1, 64, 4095]),
                     values=signs(False, True, True, False), scales=f32(0.75)),
    # invalid
    "bitmap_bit_past_count": seed(SHAPE_64, BITMAP_F16, count=10, nnz=1, indices=bitmap(16, [12]), values=f16(1.0)),
    "bitmap_popcount_mismatch": seed(SHAPE_64, BITMAP_F32, count=16, nnz=2, indices=bitmap(16, [3]),
                                     values=f32(1.0, 2.0)),
    "dct_sign_unaligned": seed(SHAPE_2500, DCT_SIGN, offset=1, count=2499, nnz=1, indices=b"\x00",
                               values=signs(True), scales=f32(1.0)),
    "dct_sign_padding_bits": seed(SHAPE_2500, DCT_SIGN, count=2500, nnz=1, indices=b"\x05",
                                  values=b"\xff", scales=f32(1.0)),
    "bad_tensor_index": seed(SHAPE_64, DENSE_F32, tensor=3, count=1, values=f32(1.0)),
    "negative_dim_tensor": seed(SHAPE_64, DENSE_F32, tensor=2, count=1, values=f32(1.0)),
    "range_wraps": seed(SHAPE_64, DENSE_F32, offset=(1 << 64) - 1, count=2, values=f32(1.0, 2.0)),
    "dense_short_values": seed(SHAPE_64, DENSE_F32, count=4, values=f32(1.0, 2.0, 3.0)),
    "dense_nan_last": seed(SHAPE_64, DENSE_F32, count=4, values=f32(1.0, 2.0, 3.0, float("nan"))),
    "sparse_duplicate": seed(SHAPE_64, SPARSE_F32, count=64, nnz=2, indices=b"\x05\x00", values=f32(1.0, 2.0)),
    "sparse_overlong_varint": seed(SHAPE_2500, SPARSE_F32, count=1000, nnz=2, indices=b"\x01\x82\x00",
                                   values=f32(1.0, 2.0)),
    "sparse_truncated_varint": seed(SHAPE_2500, SPARSE_F16, count=1000, nnz=2, indices=b"\x01\x80",
                                    values=f16(1.0, 2.0)),
    "sparse_int8_inf_scale": seed(SHAPE_64, SPARSE_INT8, count=64, nnz=1, indices=b"\x00", values=b"\x01",
                                  scales=f32(float("inf"))),
    "int4_minus_8": seed(SHAPE_64, BLOCK_INT4, count=4, block_size=4, values=int4(1, -8, 2, 3), scales=f32(1.0)),
    "block_size_zero": seed(SHAPE_64, BLOCK_INT8, count=4, block_size=0, values=bytes(4), scales=f32(1.0)),
    "unknown_encoding": seed(SHAPE_64, 12, count=1, values=f32(1.0)),
}


def main():
    os.makedirs(OUT, exist_ok=True)
    for name, data in sorted(SEEDS.items()):
        assert len(data) < 4096, name
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(data)
    print("wrote %d seeds to %s" % (len(SEEDS), OUT))


if __name__ == "__main__":
    main()
