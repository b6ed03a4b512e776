"""Loopback ports for the real-process tests and benchmarks.

free_ports(count) finds `count` consecutive TCP ports free on 127.0.0.1, below
Linux's ephemeral range (32768..60999), so that no outgoing connection can
take one between this check and the process's bind.
"""
import os
import random
import socket
import time


def port_free(port):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_ports(count):
    rng = random.Random(os.getpid() ^ int(time.time()))
    for _ in range(200):
        base = rng.randrange(20000, 32000 - count)
        if all(port_free(base + i) for i in range(count)):
            return base
    raise SystemExit(f"no {count} consecutive free ports below 32000 on 127.0.0.1")
