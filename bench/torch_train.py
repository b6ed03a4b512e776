#!/usr/bin/env python3
"""PyTorch reference trainer for the fedmesh throughput comparison (CPU or CUDA).

Trains the same models as `fedmesh train` (mlp / cnn on Fashion-MNIST) the way
a typical PyTorch user would -- TensorDataset + DataLoader(shuffle=True),
model.train(), zero_grad / forward / loss / backward / step with AdamW -- and
prints ONE JSON line on stdout:

  {"framework": "pytorch", "torch_version": ..., "model": ..., "batch_size": ...,
   "threads": ..., "samples_per_second": ..., "train_seconds": ...,
   "test_accuracy": ..., "test_loss": ..., "device": ..., "precision": ...,
   "compiled": ..., ...}

Timing: time.perf_counter() around the training loop only (batch fetching
included, evaluation excluded).  The first --warmup-steps optimizer steps
(default 1 on the CPU without --compile, else 5) are a warm-up and are
excluded from the timing and from the sample count; they are still real
training steps, so the model sees exactly the same number of updates as an
untimed run (one epoch = ceil(N / batch) steps; --steps N = N steps in total,
N - warm-up of them timed).

--device cuda: the model, the optimizer state and every batch on the GPU;
torch.cuda.synchronize() before each timer read (no sync inside the timed
loop, so there is no per-step median there: median_step_ms/p90_step_ms are
null and mean_step_ms is the timed time / timed steps).  The default batch
source on cuda is --loader resident: the whole training set copied to the GPU
once and batches gathered there by a torch.randperm per epoch (the fast,
tuned way; --loader dataloader keeps the DataLoader on the host and copies
each batch with .to(device)).  Refused with exit status 2 when
torch.cuda.is_available() is false.

--precision bf16|fp16: torch.autocast(device_type=--device, dtype=...) around
forward and loss, the weights and the AdamW state stay fp32 (master weights);
fp16 on cuda adds a GradScaler (dynamic loss scaling).  A combination this
torch's autocast does not support (fp16 on the CPU in older torch) is refused
with exit status 2.

--compile: the model goes through torch.compile(model, dynamic=False,
mode=--compile-mode) (PyTorch >= 2.0; refused with exit 2 otherwise).
Compilation happens inside the warm-up steps; when the run will see a smaller
last batch of an epoch, that shape is compiled before timing too (one
forward + backward on a slice, gradients dropped, no optimizer step).
warmup_seconds is the wall time of all that, compile_seconds the estimate
warmup_seconds - warm-up steps x mean timed step time.  Evaluation uses the
uncompiled module (same weights).

Data: the IDX files (*-idx?-ubyte.gz, or uncompressed) are read directly with
gzip + numpy; nothing is downloaded and torchvision is not needed.  Pixels
are normalized as (x/255 - 0.2860)/0.3530, shape (N, 1, 28, 28).

Only Debian's python3-torch is expected.  If the interpreter running this
script cannot import torch (e.g. a pyenv/venv python3 shadows the system one)
the script re-executes itself with /usr/bin/python3.
"""

import argparse
import contextlib
import gzip
import json
import os
import platform
import sys
import time
import warnings

DEFAULT_DATA_DIR = "/usr/share/datasets/fashion-mnist"
MEAN = 0.2860
STD = 0.3530
SYSTEM_PYTHON = "/usr/bin/python3"


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="PyTorch training-throughput reference for fedmesh on the CPU or one CUDA GPU "
                    "(Fashion-MNIST, AdamW lr=1e-3 wd=1e-4, cross-entropy). "
                    "Prints one JSON line on stdout.")
    p.add_argument("--model", choices=["mlp", "cnn"], required=True,
                   help="mlp: 784-512-256-10 ReLU MLP; cnn: 2x(conv3x3+ReLU+maxpool2) + 3136-128-10")
    p.add_argument("--batch-size", type=int, default=64, help="training batch size (default 64)")
    p.add_argument("--threads", type=int, default=2,
                   help="intra-op threads: torch.set_num_threads, also OMP/OpenBLAS thread env (default 2)")
    p.add_argument("--epochs", type=int, default=1, help="training epochs (default 1; ignored with --steps)")
    p.add_argument("--steps", type=int, default=None,
                   help="train exactly N optimizer steps in total (the first --warmup-steps are untimed); "
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
    p.add_argument("--loader", choices=["dataloader", "resident"], default=None,
                   help="batch source: dataloader = DataLoader(TensorDataset, shuffle=True) on the host, "
                        "each batch .to(--device) (the default on cpu); resident = the training set "
                        "copied to --device once, batches gathered there by a torch.randperm per epoch "
                        "(the default on cuda)")
    add_device_args(p)
    p.add_argument("--verbose", "-v", action="store_true", help="progress on stderr")
    a = p.parse_args(argv)
    if a.batch_size < 1:
        p.error("--batch-size must be >= 1")
    if a.threads < 1:
        p.error("--threads must be >= 1")
    if a.steps is None and a.epochs < 1:
        p.error("--epochs must be >= 1")
    resolve_warmup(p, a)
    if a.loader is None:
        a.loader = "resident" if a.device == "cuda" else "dataloader"
    if a.blas_threads is not None and a.blas_threads < 1:
        p.error("--blas-threads must be >= 1")
    if a.train_limit is not None and a.train_limit < 1:
        p.error("--train-limit must be >= 1")
    return a


# ----------------------------------------------------------------------------
# --device / --precision / --compile (shared with torch_gpt.py)
# ----------------------------------------------------------------------------

PRECISIONS = ("fp32", "bf16", "fp16")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def add_device_args(p):
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu (default) or cuda: model, optimizer state and batches on the current GPU, "
                        "torch.cuda.synchronize() before every timer read; exit 2 when "
                        "torch.cuda.is_available() is false")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="fp32 (default), or bf16/fp16: torch.autocast on --device around forward and loss "
                        "with fp32 master weights and optimizer state; fp16 on cuda uses a GradScaler. "
                        "Exit 2 when this torch's autocast does not support the pair (fp16 on the CPU "
                        "in torch < 2.x)")
    p.add_argument("--compile", action="store_true",
                   help="run the model through torch.compile (PyTorch >= 2.0; exit 2 otherwise); compile "
                        "time falls in the untimed warm-up and is reported as compile_seconds")
    p.add_argument("--compile-mode", choices=COMPILE_MODES, default="default",
                   help="torch.compile mode with --compile (default: default)")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="untimed warm-up optimizer steps at the start (default: 1 on cpu without "
                        "--compile, as before; 5 with --device cuda or --compile, capped at steps-1)")


def resolve_warmup(p, a):
    """Fills a.warmup_steps and checks it against --steps."""
    if a.warmup_steps is not None:
        if a.warmup_steps < 1:
            p.error("--warmup-steps must be >= 1")
        if a.steps is not None and a.steps <= a.warmup_steps:
            p.error(f"--steps must be > --warmup-steps ({a.warmup_steps}): at least one timed step")
        return
    if a.steps is not None and a.steps < 2:
        p.error("--steps must be >= 2 (the first step is an untimed warm-up)")
    a.warmup_steps = 1 if (a.device == "cpu" and not a.compile) else 5
    if a.steps is not None:
        a.warmup_steps = min(a.warmup_steps, a.steps - 1)


def refuse(prog, message):
    """A setup this machine or this torch cannot run: one line on stderr, exit 2."""
    print(f"{prog}: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


class Runtime:
    """What --device / --precision / --compile turned into."""

    def __init__(self, args, prog):
        import torch
        self.torch = torch
        self.device_kind = args.device
        self.precision = args.precision
        if args.device == "cuda":
            if not torch.cuda.is_available():
                why = ("this torch build has no CUDA" if getattr(torch.version, "cuda", None) is None
                       else "no usable CUDA device or driver")
                refuse(prog, f"--device cuda: torch {torch.__version__} sees no GPU "
                             f"(torch.cuda.is_available() is False: {why}); use --device cpu")
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.device_name = torch.cuda.get_device_name(self.device)
        else:
            self.device = torch.device("cpu")
            self.device_name = platform.processor() or platform.machine()
        if args.compile and not hasattr(torch, "compile"):
            refuse(prog, f"--compile: torch {torch.__version__} has no torch.compile (it needs PyTorch >= 2.0)")
        self.amp_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.precision]
        if self.amp_dtype is not None:
            if args.device == "cuda" and args.precision == "bf16" and not torch.cuda.is_bf16_supported():
                refuse(prog, f"--precision bf16: {self.device_name} does not support bfloat16")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    probe = torch.autocast(device_type=args.device, dtype=self.amp_dtype)
                except (RuntimeError, ValueError, TypeError) as e:
                    refuse(prog, f"--precision {args.precision} on {args.device}: torch {torch.__version__}'s "
                                 f"autocast refuses it ({e})")
            if not getattr(probe, "_enabled", True):
                why = " ".join(str(caught[0].message).split()) if caught else "autocast disabled itself"
                refuse(prog, f"--precision {args.precision} on {args.device}: torch {torch.__version__}'s "
                             f"autocast does not support it ({why.strip()}); use --precision bf16 or fp32")
        self.scaler = None
        if args.precision == "fp16" and args.device == "cuda":
            try:
                self.scaler = torch.amp.GradScaler("cuda")
            except (AttributeError, TypeError):
                self.scaler = torch.cuda.amp.GradScaler()
        self.compiled = bool(args.compile)
        self.compile_mode = args.compile_mode if args.compile else None

    def autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return self.torch.autocast(device_type=self.device_kind, dtype=self.amp_dtype)

    def compile(self, model):
        """The module to train with: torch.compile(model) with --compile (lazy:
        the first calls compile), else the model itself."""
        if not self.compiled:
            return model
        mode = None if self.compile_mode == "default" else self.compile_mode
        return self.torch.compile(model, mode=mode, dynamic=False)

    def backward_and_step(self, loss, optimizer):
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            loss.backward()
            optimizer.step()

    def synchronize(self):
        if self.device_kind == "cuda":
            self.torch.cuda.synchronize(self.device)

    def describe(self):
        """JSON fields every result carries."""
        torch = self.torch
        tf32 = None
        if self.device_kind == "cuda":
            tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
        return {
            "device": self.device_kind,
            "device_name": self.device_name,
            "precision": self.precision,
            "compiled": self.compiled,
            "compile_mode": self.compile_mode,
            "grad_scaler": self.scaler is not None,
            "cuda_version": getattr(torch.version, "cuda", None) if self.device_kind == "cuda" else None,
            "tf32_matmul": tf32,
        }


def timing_report(log, rt, step_times, train_seconds, timed_steps, warmup, warmup_seconds, on_cuda):
    """(median_step_ms, p90_step_ms, mean_step_ms, compile_seconds), logged.
    The per-step times are None on cuda (no sync inside the timed loop);
    compile_seconds (None unless compiled) is the warm-up's time beyond what
    its steps would take at the timed steps' pace."""
    mean_ms = 1e3 * train_seconds / timed_steps if timed_steps > 0 else None
    median_ms = p90_ms = None
    if not on_cuda and step_times:
        times = sorted(step_times)
        median_ms = 1e3 * times[len(times) // 2]
        p90_ms = 1e3 * times[min(len(times) - 1, (9 * len(times)) // 10)]
        log(f"step time: median {median_ms:.2f} ms, p90 {p90_ms:.2f} ms")
    compile_seconds = None
    if rt.compiled:
        compile_seconds = max(0.0, warmup_seconds - warmup * train_seconds / timed_steps)
        log(f"warm-up {warmup_seconds:.2f}s, of which about {compile_seconds:.2f}s compiling")
    return median_ms, p90_ms, mean_ms, compile_seconds


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


def evaluate(model, x, y, batch_size, rt):
    import torch
    from torch.nn import functional as F
    model.eval()
    correct = 0
    loss_sum = 0.0
    with torch.no_grad():
        for i in range(0, x.shape[0], batch_size):
            xb = x[i:i + batch_size].to(rt.device)
            yb = y[i:i + batch_size].to(rt.device)
            with rt.autocast():
                logits = model(xb)
            loss_sum += F.cross_entropy(logits.float(), yb, reduction="sum").item()
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

    rt = Runtime(args, "torch_train.py")
    on_cuda = args.device == "cuda"
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

    model = build_model(args.model).to(rt.device)
    train_model = rt.compile(model)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
    log(f"device {args.device} ({rt.device_name}), precision {args.precision}, "
        f"{'torch.compile mode ' + rt.compile_mode if rt.compiled else 'eager'}, loader {args.loader}, "
        f"{args.warmup_steps} warm-up step(s)")

    train_count = int(x_train.shape[0])
    steps_per_epoch = (train_count + args.batch_size - 1) // args.batch_size
    if args.loader == "dataloader":
        loader = DataLoader(TensorDataset(x_train, y_train), batch_size=args.batch_size,
                            shuffle=True, drop_last=False, num_workers=0,
                            generator=torch.Generator().manual_seed(args.seed))

        def epoch_batches():
            for xb, yb in loader:
                if on_cuda:
                    xb = xb.to(rt.device, non_blocking=True)
                    yb = yb.to(rt.device, non_blocking=True)
                yield xb, yb
    else:  # resident: the whole training set on the device, shuffled there
        x_dev, y_dev = x_train.to(rt.device), y_train.to(rt.device)
        shuffle = torch.Generator().manual_seed(args.seed)

        def epoch_batches():
            order = torch.randperm(train_count, generator=shuffle).to(rt.device)
            for begin in range(0, train_count, args.batch_size):
                index = order[begin:begin + args.batch_size]
                yield x_dev[index], y_dev[index]

    total_steps = args.steps if args.steps is not None else args.epochs * steps_per_epoch
    warmup = args.warmup_steps
    if total_steps <= warmup:
        sys.exit(f"torch_train.py: need more than {warmup} training steps ({warmup} warm-up + at least 1 timed)")
    tail = train_count % args.batch_size  # size of each epoch's last, smaller batch (0: none)

    def precompile_tail():
        """--compile, dynamic=False: compile the short last batch's shape before
        timing (forward + backward, gradients dropped, weights untouched)."""
        xb, yb = x_train[:tail].to(rt.device), y_train[:tail].to(rt.device)
        with rt.autocast():
            loss = criterion(train_model(xb), yb)
        loss.backward()
        optimizer.zero_grad(set_to_none=True)

    model.train()
    step = 0
    timed_samples = 0
    t_start = time.perf_counter()
    t0 = t_prev = None
    warmup_seconds = None
    step_times = []
    last_loss = None
    epoch = 0
    while step < total_steps:
        epoch += 1
        for xb, yb in epoch_batches():
            optimizer.zero_grad()
            with rt.autocast():
                loss = criterion(train_model(xb), yb)
            rt.backward_and_step(loss, optimizer)
            step += 1
            if step < warmup:
                pass
            elif step == warmup:
                last_loss = loss.item()  # also syncs
                if rt.compiled and tail and total_steps >= steps_per_epoch and warmup < steps_per_epoch:
                    precompile_tail()
                rt.synchronize()
                t0 = t_prev = time.perf_counter()  # timing starts after the warm-up
                warmup_seconds = t0 - t_start
            else:
                timed_samples += xb.shape[0]
                if not on_cuda:  # a per-step timer read would need a sync on cuda
                    t_now = time.perf_counter()
                    step_times.append(t_now - t_prev)  # includes fetching the batch
                    t_prev = t_now
            if step >= total_steps:
                break
    rt.synchronize()
    train_seconds = time.perf_counter() - t0
    last_loss = loss.item()
    timed_steps = step - warmup
    sps = timed_samples / train_seconds if train_seconds > 0 else None
    log(f"{step} steps ({epoch} epoch(s)), {timed_samples} timed samples in {train_seconds:.3f}s "
        f"-> {sps:.1f} samples/s, last loss {last_loss:.4f}")

    median_step_ms, p90_step_ms, mean_step_ms, compile_seconds = timing_report(
        log, rt, step_times, train_seconds, timed_steps, warmup, warmup_seconds, on_cuda)

    test_acc = test_loss = None
    if not args.no_eval:
        t_eval = time.perf_counter()
        test_acc, test_loss = evaluate(model, x_test, y_test, args.eval_batch_size, rt)
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
        "timed_steps": timed_steps,
        "timed_samples": timed_samples,
        "epochs": args.epochs if args.steps is None else None,
        "train_samples": train_count,
        "final_train_loss": last_loss,
        # Diagnostics for noisy machines: per-step wall time of the timed steps
        # (median/p90: CPU only; mean: timed time / timed steps).
        "median_step_ms": median_step_ms,
        "p90_step_ms": p90_step_ms,
        "mean_step_ms": mean_step_ms,
        "seed": args.seed,
        "mkldnn": bool(torch.backends.mkldnn.is_available()),
        "openblas_threads": int(os.environ["OPENBLAS_NUM_THREADS"]),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "python": platform.python_version(),
        "loader": args.loader,
        "warmup_steps": warmup,
        "warmup_seconds": warmup_seconds,
        "compile_seconds": compile_seconds,
    }
    result.update(rt.describe())
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
