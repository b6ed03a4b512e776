"""A running process's peak resident set, for the benchmarks that watch the
memory of real fedmesh processes (large_round.py, large_gossip.py)."""


def status_kb(pid, field):
    """`field` (e.g. VmHWM, VmRSS) of /proc/PID/status in KiB, or None once
    the process is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_kb(pid):
    """VmHWM of /proc/PID/status in KiB, or None once the process is gone."""
    return status_kb(pid, "VmHWM")
