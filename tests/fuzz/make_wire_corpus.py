#!/usr/bin/env python3
"""Writes the seed corpus of fuzz_wire (tests/fuzz/corpus/wire/).

Each seed is byte 0 (the mode, see fuzz_wire.cpp) followed by either a whole
frame (envelope + Cap'n Proto body) or, in chunk mode, a chunk body alone.
Bodies are made by `capnp encode` from protocol/fedmesh.capnp, so the seeds
follow the schema as it is. Run from the repository root:
    python3 tests/fuzz/make_wire_corpus.py
"""
import os
import struct
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCHEMA = os.path.join(ROOT, "protocol", "fedmesh.capnp")
OUT = os.path.join(ROOT, "tests", "fuzz", "corpus", "wire")

KINDS = ["hello", "welcome", "roundAnnounce", "modelRequest", "modelChunk", "updateHeader",
         "updateChunk", "ack", "reject", "heartbeat", "ping", "pingReq", "pingAck", "siteReport",
         "catchUpRequest", "secAggUp", "secAggDown", "statsReport", "statsMerged", "updateRequest",
         "replicaHolds", "updateSeal"]


def encode(text):
    return subprocess.run(["capnp", "encode", SCHEMA, "Message"],
                          input=text.encode(), check=True, capture_output=True).stdout


def frame(kind, body, chunk=0, sequence=0):
    return struct.pack("<IHHIIQ", 0x48534D46, 1, KINDS.index(kind), len(body), chunk, sequence) + body


def hexdata(values):
    return '0x"' + values.hex() + '"'


def floats(*xs):
    return struct.pack("<%df" % len(xs), *xs)


def main():
    os.makedirs(OUT, exist_ok=True)
    hash32 = hexdata(bytes(range(32)))
    sig64 = hexdata(bytes(64))
    seeds = {
        "hello": b"\x00" + frame("hello", encode(
            '(hello = (federation = "fed", siteName = "site-a", role = site, protocolVersion = 1, '
            'minProtocolVersion = 1, capabilities = (encodings = [denseF32, blockInt4], maxMessageBytes = 4259840)))')),
        "heartbeat": b"\x00" + frame("heartbeat", encode("(heartbeat = (sentUnixMs = 5, round = 1))")),
        "reject": b"\x00" + frame("reject", encode('(reject = (sequence = 1, code = nonFinite, text = "NaN"))')),
        "ping_req": b"\x00" + frame("pingReq", encode(
            '(pingReq = (probe = 3, target = "site-b", deltas = [(site = "site-c", status = suspect, incarnation = 2)]))')),
        "ping": b"\x00" + frame("ping", encode(
            '(ping = (probe = 7, version = 12, deltas = [(site = "site-a", status = dead, incarnation = 1), '
            '(site = "site-c", status = suspect, incarnation = 4, accuser = "site-b")]))')),
        "ping_ack": b"\x00" + frame("pingAck", encode(
            '(pingAck = (probe = 7, target = "site-c", version = 3, deltas = [(site = "site-b", status = left, incarnation = 9)]))')),
        "catch_up_request": b"\x00" + frame("catchUpRequest", encode('(catchUpRequest = (slice = 1, slices = 3))')),
        "update_request": b"\x00" + frame("updateRequest", encode(
            '(updateRequest = (round = 4, sequence = 1700000000000000, haveChunks = 0x"ff7f01"))')),
        "replica_holds": b"\x00" + frame("replicaHolds", encode('(replicaHolds = (below = 30))')),
        "secagg_up_advertise": b"\x00" + frame("secAggUp", encode(
            '(secAggUp = (round = 1, session = "s", advertise = (site = "site-a", cipherPublic = 0x"%s", '
            'maskPublic = 0x"%s", signature = 0x"%s")))' % ("01" * 32, "02" * 32, "03" * 64))),
        "secagg_up_masked": b"\x00" + frame("secAggUp", encode(
            '(secAggUp = (round = 1, session = "s", masked = (offset = 0, words = 0x"%s")))' % ("07000000" * 8))),
        "secagg_up_reveals": b"\x00" + frame("secAggUp", encode(
            '(secAggUp = (round = 1, session = "s", reveals = [(owner = "site-b", maskKey = true, point = 1, '
            'share = 0x"%s")]))' % ("05" * 32))),
        "secagg_down_unmask": b"\x00" + frame("secAggDown", encode(
            '(secAggDown = (round = 1, session = "s", phase = unmask, member = true, threshold = 2, length = 8, '
            'invited = 2, clip = 1.0, fractionBits = 16, alive = ["site-a", "site-b"], dropped = [], '
            'signatures = [(site = "site-b", signature = 0x"%s")]))' % ("09" * 64))),
        "secagg_down_share_keys": b"\x00" + frame("secAggDown", encode(
            '(secAggDown = (round = 1, session = "s", phase = shareKeys, member = true, threshold = 2, length = 8, '
            'invited = 2, advertisements = [(site = "site-a", cipherPublic = 0x"%s", maskPublic = 0x"%s", '
            'signature = 0x"%s"), (site = "site-b", cipherPublic = 0x"%s", maskPublic = 0x"%s", signature = 0x"%s")]))'
            % ("01" * 32, "02" * 32, "03" * 64, "04" * 32, "05" * 32, "06" * 64))),
        "model_chunk": b"\x00" + frame("modelChunk", encode(
            '(modelChunk = (version = 1, chunkIndex = 0, chunkCount = 1, tensors = [(name = "w", shape = [8, 4])], '
            'segments = [(tensor = 0, encoding = denseF32, offset = 0, count = 2, values = %s)]))'
            % hexdata(floats(1.0, 2.0))), chunk=0),
        "update_header": b"\x00" + frame("updateHeader", encode(
            '(updateHeader = (federation = "fed", round = 1, baseVersion = 1, sender = "site-a", '
            'recipient = "aggregator", sequence = 1, sampleCount = 10, '
            'tensors = [(name = "w", shape = [8, 4], encoding = denseF32), (name = "b", shape = [8], encoding = denseF32)], '
            'chunkCount = 1, chunkHashes = [%s], signature = %s))' % (hash32, sig64))),
        "update_chunk_frame": b"\x00" + frame("updateChunk", encode(
            '(updateChunk = (sequence = 1, chunkIndex = 0, segments = [(tensor = 1, encoding = denseF32, offset = 0, '
            'count = 2, values = %s)]))' % hexdata(floats(0.5, -0.5))), chunk=0, sequence=1),
        "update_seal": b"\x00" + frame("updateSeal", encode(
            '(updateSeal = (sequence = 1, chunkCount = 1, chunkHashes = [%s], signature = %s))' % (hash32, sig64))),
    }
    # Chunk mode: byte 0 = 1 | encoding << 1 (| 0x80: sealed), then a chunk body.
    dense = ('(updateChunk = (sequence = 1, chunkIndex = 0, segments = ['
             '(tensor = 0, encoding = denseF32, offset = 0, count = 32, values = %s), '
             '(tensor = 1, encoding = denseF32, offset = 0, count = 8, values = %s)]))'
             % (hexdata(floats(*[0.25 * i for i in range(32)])), hexdata(floats(*[1.0] * 8))))
    seeds["chunk_dense_f32"] = bytes([1 | (0 << 1)]) + encode(dense)
    seeds["chunk_dense_nan"] = bytes([1]) + encode(dense.replace(hexdata(floats(*[1.0] * 8)),
                                                                 hexdata(floats(*[1.0] * 7, float("nan")))))
    sparse = ('(updateChunk = (sequence = 1, chunkIndex = 0, segments = ['
              '(tensor = 0, encoding = sparseF32, offset = 0, count = 32, nnz = 3, indices = 0x"010305", values = %s)]))'
              % hexdata(floats(1.0, 2.0, 3.0)))
    seeds["chunk_sparse_f32"] = bytes([1 | (3 << 1)]) + encode(sparse)
    block = ('(updateChunk = (sequence = 1, chunkIndex = 0, segments = ['
             '(tensor = 0, encoding = blockInt8, offset = 0, count = 8, blockSize = 4, values = 0x"017f81000203fdfe", '
             'scales = %s)]))' % hexdata(floats(0.5, 0.25)))
    seeds["chunk_block_int8"] = bytes([1 | (6 << 1)]) + encode(block)
    int4 = ('(updateChunk = (sequence = 1, chunkIndex = 0, segments = ['
            '(tensor = 1, encoding = blockInt4, offset = 0, count = 8, blockSize = 4, values = 0x"1f2e3d4c", '
            'scales = %s)]))' % hexdata(floats(0.5, 0.25)))
    seeds["chunk_block_int4"] = bytes([1 | (7 << 1)]) + encode(int4)
    seeds["sealed_chunk_dense_f32"] = bytes([0x80 | 1 | (0 << 1)]) + encode(dense)
    seeds["sealed_chunk_sparse_f32"] = bytes([0x80 | 1 | (3 << 1)]) + encode(sparse)
    seeds["sealed_chunk_block_int8"] = bytes([0x80 | 1 | (6 << 1)]) + encode(block)
    for name, data in seeds.items():
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(data)
    print("wrote %d seeds to %s" % (len(seeds), OUT), file=sys.stderr)


if __name__ == "__main__":
    main()
