#!/usr/bin/env python3
"""PyTorch CPU reference trainer for the fedmesh throughput comparison.

Trains the same models as `fedmesh train` (mlp / cnn on Fashion-MNIST) the way
a typical PyTorch user would -- TensorDataset + DataLoader(shuffle=True),
model.train(), zero_grad / forward / loss / backward / step with AdamW -- and
prints ONE JSON line on stdout:

  {"framework": "pytorch", "torch_version": ..., "model": ..., "batch_size": ...,
   "threads": ..., "samples_per_second": ..., "train_seconds": ...,
   "test_accuracy": ..., "test_loss": ..., ...}

Timing: time.perf_counter() around the training loop only (DataLoader
iteration included, evaluation excluded).  The very first optimizer step is a
warm-up step and is excluded from the timing and from the sample count; it is
still a real training step, so the model sees exactly the same number of
updates as an untimed run (one epoch = ceil(N / batch) steps; --steps N =
N steps in total, N-1 of them timed).

Data: the IDX files (*-idx?-ubyte.gz, or uncompressed) are read directly with
gzip + numpy; nothing is downloaded and torchvision is not needed.  Pixels
are normalized as (x/255 - 0.2860)/0.3530, shape (N, 1, 28, 28).

Only Debian's python3-torch is expected.  If the interpreter running this
script cannot import torch (e.g. a pyenv/venv python3 shadows the system one)
the script re-executes itself with /usr/bin/python3.
"""

import argparse
import gzip
import json
import os
import platform
import sys
import time

DEFAULT_DATA_DIR = "/usr/share/datasets/fashion-mnist"
MEAN = 0.2860
STD = 0.3530
SYSTEM_PYTHON = "/usr/bin/python3"


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="PyTorch CPU training-throughput reference for fedmesh "
                    "(Fashion-MNIST, AdamW lr=1e-3 wd=1e-4, cross-entropy). "
                    "Prints one JSON line on stdout.")
    p.add_argument("--model", choices=["mlp", "cnn"], required=True,
                   help="mlp: 784-512-256-10 ReLU MLP; cnn: 2x(conv3x3+ReLU+maxpool2) + 3136-128-10")
    p.add_argument("--batch-size", type=int, default=64, help="training batch size (default 64)")
    p.add_argument("--threads", type=int, default=2,
                   help="intra-op threads: torch.set_num_threads, also OMP/OpenBLAS thread env (default 2)")
    p.add_argument("--epochs", type=int, default=1, help="training epochs (default 1; ignored with --steps)")
    p.add_argument("--steps", type=int, default=None,
                   help="train exactly N optimizer steps in total (first one is the untimed warm-up); "
                        "overrides --epochs, cycles over the data as needed")
    p.add_argument("--train-limit", type=int, default=None,
                   help="use only the first N training samples")
    p.add_argument("--test-limit", type=int, default=None,
                   help="evaluate on only the first N test samples")
    p.add_argument("--eval-batch-size", type=int, default=1000, help="evaluation batch size (default 1000)")
    p.add_argument("--no-eval", action="store_true", help="skip test-set evaluation (accuracy/loss = null)")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help=f"IDX files directory (default {DEFAULT_DATA_DIR})")
    p.add_argument("--seed", type=int, default=0, help="RNG seed for init and shuffling (default 0)")
    p.add_argument("--omp-wait-policy", choices=["passive", "active"], default=None,
                   help="set OMP_WAIT_POLICY for torch's libgomp pool (default: leave the environment "
                        "alone, as a typical user would). On Debian's torch, linear layers run in the "
                        "separate OpenBLAS pthread pool while idle libgomp workers spin, so 'passive' "
                        "can be much faster; use it for a tuned baseline")
    p.add_argument("--blas-threads", type=int, default=None,
                   help="OPENBLAS_NUM_THREADS (default: --threads)")
    p.add_argument("--verbose", "-v", action="store_true", help="progress on stderr")
    a = p.parse_args(argv)
    if a.batch_size < 1:
        p.error("--batch-size must be >= 1")
    if a.threads < 1:
        p.error("--threads must be >= 1")
    if a.steps is None and a.epochs < 1:
        p.error("--epochs must be >= 1")
    if a.steps is not None and a.steps < 2:
        p.error("--steps must be >= 2 (the first step is an untimed warm-up)")
    if a.blas_threads is not None and a.blas_threads < 1:
        p.error("--blas-threads must be >= 1")
    if a.train_limit is not None and a.train_limit < 1:
        p.error("--train-limit must be >= 1")
    return a


def configure_thread_env(args):
    # Must happen before torch (and its OpenMP / OpenBLAS / oneDNN runtimes) is
    # loaded: Debian's torch calls sgemm in the system OpenBLAS, whose pthread
    # pool is sized by OPENBLAS_NUM_THREADS and not by torch.set_num_threads().
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ["MKL_NUM_THREADS"] = str(args.threads)
    os.environ["OPENBLAS_NUM_THREADS"] = str(args.blas_threads or args.threads)
    if args.omp_wait_policy:
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()


def import_torch_or_reexec(script=None):
    """Imports torch and numpy, or re-runs `script` (default: this file) with
    Debian's /usr/bin/python3 when this interpreter cannot import them."""
    script = os.path.abspath(script or __file__)
    try:
        import numpy  # noqa: F401
        import torch  # noqa: F401
        return
    except ImportError as e:
        err = e
    if (os.path.exists(SYSTEM_PYTHON)
            and os.path.realpath(sys.executable) != os.path.realpath(SYSTEM_PYTHON)
            and not os.environ.get("FEDMESH_TORCH_REEXEC")):
        os.environ["FEDMESH_TORCH_REEXEC"] = "1"
        os.execv(SYSTEM_PYTHON, [SYSTEM_PYTHON, script] + sys.argv[1:])
    sys.exit(f"{os.path.basename(script)}: cannot import torch/numpy with {sys.executable}: {err}\n"
             "install Debian's python3-torch and python3-numpy (apt-get install python3-torch python3-numpy)")


# ----------------------------------------------------------------------------
# IDX reading
# ----------------------------------------------------------------------------

def _open_idx(data_dir, stem):
    for name, opener in ((stem + ".gz", gzip.open), (stem, open)):
        path = os.path.join(data_dir, name)
        if os.path.exists(path):
            with opener(path, "rb") as f:
                return path, f.read()
    raise FileNotFoundError(f"{stem}[.gz] not found in {data_dir}")


def read_idx(data_dir, stem):
    import numpy as np
    path, raw = _open_idx(data_dir, stem)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path}: not an IDX file")
    dtype_code, ndim = raw[2], raw[3]
    if dtype_code != 0x08:
        raise ValueError(f"{path}: unsupported IDX dtype 0x{dtype_code:02x} (expected ubyte)")
    dims = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    offset = 4 + 4 * ndim
    count = 1
    for d in dims:
        count *= d
    if len(raw) - offset != count:
        raise ValueError(f"{path}: size mismatch ({len(raw) - offset} bytes for dims {dims})")
    return np.frombuffer(raw, dtype=np.uint8, offset=offset).reshape(dims)


def load_split(data_dir, prefix, limit):
    import numpy as np
    import torch
    images = read_idx(data_dir, f"{prefix}-images-idx3-ubyte")
    labels = read_idx(data_dir, f"{prefix}-labels-idx1-ubyte")
    if images.shape[0] != labels.shape[0]:
        raise ValueError(f"{prefix}: {images.shape[0]} images vs {labels.shape[0]} labels")
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    x = images.astype(np.float32).reshape(-1, 1, images.shape[1], images.shape[2])
    x = (x / np.float32(255.0) - np.float32(MEAN)) / np.float32(STD)
    return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(labels.astype(np.int64))


# ----------------------------------------------------------------------------
# Models (must match fedmesh's exactly)
# ----------------------------------------------------------------------------

def build_model(name):
    from torch import nn
    if name == "mlp":
        return nn.Sequential(
            nn.Flatten(),
            nn.Linear(784, 512), nn.ReLU(),
            nn.Linear(512, 256), nn.ReLU(),
            nn.Linear(256, 10))
    if name == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(3136, 128), nn.ReLU(),
            nn.Linear(128, 10))
    raise ValueError(name)


def evaluate(model, x, y, batch_size):
    import torch
    from torch.nn import functional as F
    model.eval()
    correct = 0
    loss_sum = 0.0
    with torch.no_grad():
        for i in range(0, x.shape[0], batch_size):
            xb, yb = x[i:i + batch_size], y[i:i + batch_size]
            logits = model(xb)
            loss_sum += F.cross_entropy(logits, yb, reduction="sum").item()
            correct += (logits.argmax(dim=1) == yb).sum().item()
    n = x.shape[0]
    return correct / n, loss_sum / n


def main():
    args = parse_args()
    configure_thread_env(args)
    import_torch_or_reexec()

    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set / parallel work already started
        pass
    torch.manual_seed(args.seed)

    def log(msg):
        if args.verbose:
            print(f"[torch_train] {msg}", file=sys.stderr, flush=True)

    t_load = time.perf_counter()
    x_train, y_train = load_split(args.data_dir, "train", args.train_limit)
    x_test, y_test = (None, None) if args.no_eval else load_split(args.data_dir, "t10k", args.test_limit)
    log(f"loaded {x_train.shape[0]} train samples in {time.perf_counter() - t_load:.2f}s")

    model = build_model(args.model)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
    loader = DataLoader(TensorDataset(x_train, y_train), batch_size=args.batch_size,
                        shuffle=True, drop_last=False, num_workers=0,
                        generator=torch.Generator().manual_seed(args.seed))

    steps_per_epoch = len(loader)
    total_steps = args.steps if args.steps is not None else args.epochs * steps_per_epoch
    if total_steps < 2:
        sys.exit("torch_train.py: need at least 2 training steps (1 warm-up + 1 timed)")

    model.train()
    step = 0
    timed_samples = 0
    t0 = t_prev = None
    step_times = []
    last_loss = None
    epoch = 0
    while step < total_steps:
        epoch += 1
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = criterion(model(xb), yb)
            loss.backward()
            optimizer.step()
            step += 1
            if step == 1:
                last_loss = loss.item()  # also syncs; nothing is async on CPU anyway
                t0 = t_prev = time.perf_counter()  # timing starts after the warm-up step
            else:
                timed_samples += xb.shape[0]
                t_now = time.perf_counter()
                step_times.append(t_now - t_prev)  # includes fetching the batch
                t_prev = t_now
            if step >= total_steps:
                break
    train_seconds = time.perf_counter() - t0
    last_loss = loss.item()
    sps = timed_samples / train_seconds if train_seconds > 0 else None
    log(f"{step} steps ({epoch} epoch(s)), {timed_samples} timed samples in {train_seconds:.3f}s "
        f"-> {sps:.1f} samples/s, last loss {last_loss:.4f}")

    step_times.sort()
    median_step_ms = 1e3 * step_times[len(step_times) // 2]
    p90_step_ms = 1e3 * step_times[min(len(step_times) - 1, (9 * len(step_times)) // 10)]
    log(f"step time: median {median_step_ms:.2f} ms, p90 {p90_step_ms:.2f} ms")

    test_acc = test_loss = None
    if not args.no_eval:
        t_eval = time.perf_counter()
        test_acc, test_loss = evaluate(model, x_test, y_test, args.eval_batch_size)
        log(f"eval: accuracy {test_acc:.4f}, loss {test_loss:.4f} ({time.perf_counter() - t_eval:.2f}s)")

    result = {
        "framework": "pytorch",
        "torch_version": torch.__version__,
        "model": args.model,
        "batch_size": args.batch_size,
        "threads": args.threads,
        "samples_per_second": sps,
        "train_seconds": train_seconds,
        "test_accuracy": test_acc,
        "test_loss": test_loss,
        "steps": step,
        "timed_steps": step - 1,
        "timed_samples": timed_samples,
        "epochs": args.epochs if args.steps is None else None,
        "train_samples": int(x_train.shape[0]),
        "final_train_loss": last_loss,
        # Diagnostics for noisy machines: per-step wall time of the timed steps.
        "median_step_ms": median_step_ms,
        "p90_step_ms": p90_step_ms,
        "seed": args.seed,
        "mkldnn": bool(torch.backends.mkldnn.is_available()),
        "openblas_threads": int(os.environ["OPENBLAS_NUM_THREADS"]),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "python": platform.python_version(),
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
