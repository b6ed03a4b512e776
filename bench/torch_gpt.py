#!/usr/bin/env python3
"""PyTorch reference trainer for the fedmesh language-model throughput comparison (CPU or CUDA).

Trains the same GPT-2-style decoder as `fedmesh train --model gpt-nano|gpt-tiny|gpt-small|gpt2`
the way a typical PyTorch user would write it (nanoGPT style: nn.Module with
nn.Embedding, nn.LayerNorm, nn.Linear, F.gelu(approximate="tanh"), causal
self-attention computed by hand with a registered lower-triangular mask --
Debian bookworm's torch 1.13 has no F.scaled_dot_product_attention; when the
installed torch has it, it is used with is_causal=True and the JSON says so),
zero_grad / forward / loss / backward / step with AdamW, and prints ONE JSON
line on stdout:

  {"framework": "pytorch", "torch_version": ..., "model": ..., "batch_size": ...,
   "threads": ..., "tokens_per_second": ..., "train_seconds": ...,
   "final_train_loss": ..., "test_loss": ..., "bits_per_byte": ..., "device": ...,
   "precision": ..., "compiled": ..., "flops_per_token": ..., "mfu": ..., ...}

Model (must match fedmesh's train/model.cpp + train/layers/transformer.cpp):
  token embedding wte (V, C) + learned positions wpe (context, C), V = 256
  for gpt-nano/tiny/small and 50257 for gpt2 (fedmesh's gpt2 keeps GPT-2's
  vocabulary with the byte tokenizer: only ids 0-255 occur);
  per block x + attn(ln_1(x)), then + mlp(ln_2(.)); attention c_attn
  Linear(C, 3C) laid out [q|k|v], causal softmax(q k^T / sqrt(d)) v per head,
  c_proj Linear(C, C); MLP c_fc Linear(C, 4C), GELU (tanh), c_proj
  Linear(4C, C); final LayerNorm ln_f (eps 1e-5); logits = x . wte^T (tied,
  no bias); loss = mean cross-entropy over every position's next byte.  No
  dropout.  Init as GPT-2 / fedmesh: wte N(0, 0.02), wpe N(0, 0.01), Linear
  weights N(0, 0.02) except the two projections back into the residual
  stream (attn.c_proj, mlp.c_proj) N(0, 0.02 / sqrt(2 * layers)), biases 0,
  LayerNorm weight 1, bias 0.

Optimizer: torch.optim.AdamW(lr, betas (0.9, 0.999), eps 1e-8,
weight_decay 1e-4 on every parameter), constant learning rate (fedmesh's
--schedule constant).

Data (must match fedmesh's train/data/text_corpus.cpp): `bible -f
Gen1:1-Rev22:21` (Debian's bible-kjv; $FEDMESH_BIBLE names another program), each line "Ref text": the reference
(before the first space) is dropped, its book prefix ("Ge" of "Ge1:1", "1Sm"
of "1Sm3:4") starts a new document when it changes, every verse's text is
followed by "\n"; the first 95 % of every book (rounded half up) concatenated
in book order are the training bytes, the last 5 % of every book the held-out
bytes.  Byte tokenizer (vocabulary 256).  Training samples are windows of
`context` bytes with stride `context` (targets: the next byte of each
position), reshuffled every epoch (torch.randperm), batch = B consecutive
windows of the permutation.  Evaluation: the first --test-limit windows of
the held-out bytes (fedmesh's --test-limit), mean cross-entropy per byte.

Timing: time.perf_counter() around the training loop only (batch assembly
included, evaluation excluded).  The first --warmup-steps optimizer steps
(default 1 on the CPU without --compile, else 5) are a warm-up, excluded from
the timing and from the token count; they are still real training steps, so
--steps N = N steps in total, N - warm-up of them timed.

Same start (--write-init FILE, --init FILE, --order fedmesh): PyTorch's
seeded initial weights are written once under fedmesh's parameter names
(safetensors, float32), `fedmesh train --init FILE` and this script's
--init FILE start from them, and --order fedmesh walks fedmesh's window
order (its xoshiro256** shuffle, copied here): both sides then see the same
weights and batches, and their losses differ only by rounding
(bench/compare_torch_gpt.sh --same-init; tests/bench/check_same_start.sh).

--device cuda / --precision fp32|bf16|fp16 / --compile: as bench/torch_train.py
(model, optimizer state and the tokenized windows on the GPU, batches gathered
there; torch.cuda.synchronize() before each timer read; autocast with fp32
master weights, GradScaler for fp16 on cuda; torch.compile(dynamic=False)
with compile time inside the warm-up, reported as compile_seconds; exit 2
when the GPU, the precision or torch.compile is not available).

MFU (model FLOPs utilization): tokens/s x flops_per_token / peak, with
flops_per_token = 6 x N + 12 x layers x context x width, N = the parameters
less the position embedding (the tied wte is counted once: it is the output
projection's matmul), the second term the attention scores and their
weighted sum (q k^T and att v, forward + backward, counted over the full
context as in the PaLM / nanoGPT estimate, not halved for the causal mask).
The peak is the GPU's dense bf16 tensor-core FLOP/s (whatever --precision)
from a table keyed by torch.cuda.get_device_name() (H100 SXM 989e12, H100
PCIe 756e12, H200 989e12, A100 312e12), or --peak-flops; otherwise mfu is
null and "unknown" is printed.

Only Debian's python3-torch is expected.  If the interpreter running this
script cannot import torch (e.g. a pyenv/venv python3 shadows the system one)
the script re-executes itself with /usr/bin/python3.
"""

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time

BIBLE_PROGRAM = os.environ.get("FEDMESH_BIBLE") or "/usr/bin/bible"  # as fedmesh reads it
BIBLE_RANGE = "Gen1:1-Rev22:21"
BIBLE_BOOKS = 66
HELD_OUT = 0.05

# name: (vocabulary, context, width, heads, layers) -- train/model.cpp language_model_config
CONFIGS = {
    "gpt-nano": (256, 64, 64, 4, 2),
    "gpt-tiny": (256, 128, 192, 6, 4),
    "gpt-small": (256, 256, 384, 6, 6),
    "gpt2": (50257, 1024, 768, 12, 12),
}

# Dense bf16 tensor-core peak FLOP/s by GPU (the vendors' data sheets, without sparsity).
PEAK_BF16_FLOPS = {
    "H100 SXM": 989e12,
    "H100 PCIe": 756e12,
    "H200": 989e12,
    "A100": 312e12,
}


def peak_flops_for(device_name):
    """(peak FLOP/s, table key) for torch.cuda.get_device_name(), or (None, None)."""
    n = device_name.lower()
    if "h100" in n:
        if "pcie" in n:
            return PEAK_BF16_FLOPS["H100 PCIe"], "H100 PCIe"
        if "nvl" in n:
            return None, None  # a different clock and power limit: not in the table
        return PEAK_BF16_FLOPS["H100 SXM"], "H100 SXM"  # "NVIDIA H100 80GB HBM3"
    if "h200" in n:
        return (None, None) if "nvl" in n else (PEAK_BF16_FLOPS["H200"], "H200")
    if "a100" in n:
        return PEAK_BF16_FLOPS["A100"], "A100"
    return None, None


def flops_per_token(parameters, context, width, layers):
    """6 N + 12 L T C: N = parameters less the position embedding."""
    return 6 * (parameters - context * width) + 12 * layers * context * width


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="PyTorch language-model training-throughput reference for fedmesh on the CPU "
                    "or one CUDA GPU (GPT-2-style decoder, byte tokenizer, King James Bible, AdamW "
                    "wd=1e-4, constant lr). Prints one JSON line on stdout.")
    p.add_argument("--model", choices=sorted(CONFIGS), required=True,
                   help="gpt-nano (ctx 64, C 64, 4 heads, 2 layers), gpt-tiny (ctx 128, C 192, 6 heads, "
                        "4 layers), gpt-small (ctx 256, C 384, 6 heads, 6 layers), all vocabulary 256; "
                        "gpt2 (vocabulary 50257, ctx 1024, C 768, 12 heads, 12 layers, 124M parameters)")
    p.add_argument("--batch-size", type=int, default=64, help="windows per batch (default 64)")
    p.add_argument("--threads", type=int, default=2,
                   help="intra-op threads: torch.set_num_threads, also OMP/OpenBLAS thread env (default 2)")
    p.add_argument("--steps", type=int, default=None,
                   help="train exactly N optimizer steps in total (the first --warmup-steps are untimed); "
                        "cycles over the data as needed")
    p.add_argument("--lr", type=float, default=1e-3, help="constant learning rate (default 1e-3)")
    p.add_argument("--weight-decay", type=float, default=1e-4, help="AdamW weight decay (default 1e-4)")
    p.add_argument("--test-limit", type=int, default=0,
                   help="evaluate on only the first N held-out windows (0 = all, as fedmesh)")
    p.add_argument("--eval-batch-size", type=int, default=None,
                   help="evaluation batch size (default 256, fewer where batch x context x vocabulary "
                        "logits would pass 2^30 values: 20 for gpt2)")
    p.add_argument("--no-eval", action="store_true", help="skip evaluation (test_loss = null)")
    p.add_argument("--seed", type=int, default=0, help="RNG seed for init and shuffling (default 0)")
    p.add_argument("--write-init", metavar="FILE", default=None,
                   help="write the model's seeded initial weights to FILE (safetensors, float32, under fedmesh's "
                        "parameter names: h.0.ln_1.weight -> h0.ln_1.weight) and exit; `fedmesh train --init "
                        "FILE` and this script's --init then start from the same weights")
    p.add_argument("--init-layout", choices=["fedmesh", "hf-gpt2"], default="fedmesh",
                   help="--write-init's names and layout: fedmesh's (default), or Hugging Face's GPT-2 state dict "
                        "(transformer.h.0.attn.c_attn.weight stored (in, out) as its Conv1D, the causal-mask "
                        "buffers, lm_head.weight tied to wte), which `fedmesh train --init-format hf-gpt2` reads")
    p.add_argument("--init", metavar="FILE", default=None,
                   help="start from the float32 safetensors weights in FILE (fedmesh's names: --write-init, or "
                        "`fedmesh checkpoint export`; or Hugging Face's GPT-2 layout, `checkpoint export --format "
                        "hf-gpt2`, told by its transformer.* names) instead of the seeded initialization")
    p.add_argument("--order", choices=["torch", "fedmesh"], default="torch",
                   help="each epoch's window order: torch.randperm (default), or fedmesh's own shuffle (its "
                        "xoshiro256** generator seeded from --seed, Fisher-Yates as base/random.h), so that with "
                        "--init both sides see the same batches in the same order")
    p.add_argument("--omp-wait-policy", choices=["passive", "active"], default=None,
                   help="set OMP_WAIT_POLICY for torch's libgomp pool (default: leave the environment "
                        "alone, as a typical user would). On Debian's torch, linear layers run in the "
                        "separate OpenBLAS pthread pool while idle libgomp workers spin, so 'passive' "
                        "can be much faster; use it for a tuned baseline")
    p.add_argument("--blas-threads", type=int, default=None,
                   help="OPENBLAS_NUM_THREADS (default: --threads)")
    add_device_args(p)
    p.add_argument("--peak-flops", type=float, default=None,
                   help="the accelerator's peak FLOP/s for the MFU estimate (default: dense bf16 from the "
                        "table for H100 SXM/PCIe, H200, A100 by torch.cuda.get_device_name(); else unknown)")
    p.add_argument("--verbose", "-v", action="store_true", help="progress on stderr")
    p.add_argument("--log-every", type=int, default=0,
                   help="with --verbose: log the training loss every N steps (default 0 = never; "
                        "each log calls loss.item() inside the timed loop)")
    a = p.parse_args(argv)
    if a.steps is None and a.write_init is None:
        p.error("--steps is required (unless --write-init)")
    if a.batch_size < 1:
        p.error("--batch-size must be >= 1")
    if a.threads < 1:
        p.error("--threads must be >= 1")
    resolve_warmup(p, a)
    if a.blas_threads is not None and a.blas_threads < 1:
        p.error("--blas-threads must be >= 1")
    if a.test_limit < 0:
        p.error("--test-limit must be >= 0")
    if a.eval_batch_size is not None and a.eval_batch_size < 1:
        p.error("--eval-batch-size must be >= 1")
    if a.peak_flops is not None and not a.peak_flops > 0:
        p.error("--peak-flops must be > 0")
    return a


# The thread environment, the torch import and --device/--precision/--compile are torch_train.py's.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_train import (  # noqa: E402
    Runtime, add_device_args, configure_thread_env, import_torch_or_reexec, resolve_warmup, timing_report)


# ----------------------------------------------------------------------------
# The King James Bible, as fedmesh reads it
# ----------------------------------------------------------------------------

def load_bible_books():
    """[(book, text bytes)] in order.  "Ge1:1 In the ..." -> book "Ge": the
    reference ends at the first space, the book is what precedes the chapter
    digits before its colon ("1Sm3:4" -> "1Sm"); lines without one are skipped."""
    if not os.path.exists(BIBLE_PROGRAM):
        sys.exit(f"torch_gpt.py: {BIBLE_PROGRAM} is missing: apt-get install bible-kjv"
                 " (or name another bible program in FEDMESH_BIBLE)")
    raw = subprocess.run([BIBLE_PROGRAM, "-f", BIBLE_RANGE], check=True,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL).stdout
    books = []  # [name, bytearray]
    for line in raw.split(b"\n"):
        space = line.find(b" ")
        if space <= 0:
            continue
        reference = line[:space]
        colon = reference.find(b":")
        if colon < 0:
            continue
        digits = colon
        while digits > 0 and reference[digits - 1:digits].isdigit():
            digits -= 1
        if digits == 0 or digits == colon:
            continue
        book = reference[:digits]
        if not books or books[-1][0] != book:
            books.append([book, bytearray()])
        books[-1][1] += line[space + 1:]
        books[-1][1] += b"\n"
    if len(books) != BIBLE_BOOKS:
        sys.exit(f"torch_gpt.py: {BIBLE_PROGRAM} printed {len(books)} books, not {BIBLE_BOOKS}")
    return books


def split_books(books, holdout=HELD_OUT):
    train, held_out = bytearray(), bytearray()
    for _, text in books:
        cut = int(math.floor(len(text) * (1.0 - holdout) + 0.5))  # llround (half away from zero)
        train += text[:cut]
        held_out += text[cut:]
    return bytes(train), bytes(held_out)


def windows(data, context, stride):
    """(inputs, targets) int64 tensors of shape (count, context)."""
    import numpy as np
    import torch
    n = len(data)
    count = (n - context - 1) // stride + 1 if n > context else 0
    tokens = np.frombuffer(data, dtype=np.uint8).astype(np.int64)
    starts = np.arange(count, dtype=np.int64)[:, None] * stride
    offsets = np.arange(context, dtype=np.int64)[None, :]
    x = tokens[starts + offsets]
    y = tokens[starts + offsets + 1]
    return torch.from_numpy(x), torch.from_numpy(y)


# ----------------------------------------------------------------------------
# The model (must match fedmesh's exactly)
# ----------------------------------------------------------------------------

def build_model(vocabulary, context, width, heads, layers):
    import torch
    from torch import nn
    from torch.nn import functional as F

    has_sdpa = hasattr(F, "scaled_dot_product_attention")

    class CausalSelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(width, 3 * width)
            self.c_proj = nn.Linear(width, width)
            if not has_sdpa:
                mask = torch.tril(torch.ones(context, context, dtype=torch.bool))
                self.register_buffer("mask", mask.view(1, 1, context, context), persistent=False)

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.c_attn(x).split(width, dim=2)
            q = q.view(B, T, heads, C // heads).transpose(1, 2)  # (B, nh, T, hs)
            k = k.view(B, T, heads, C // heads).transpose(1, 2)
            v = v.view(B, T, heads, C // heads).transpose(1, 2)
            if has_sdpa:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
                att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf"))
                att = F.softmax(att, dim=-1)
                y = att @ v  # (B, nh, T, hs)
            y = y.transpose(1, 2).contiguous().view(B, T, C)
            return self.c_proj(y)

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc = nn.Linear(width, 4 * width)
            self.c_proj = nn.Linear(4 * width, width)

        def forward(self, x):
            return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(width, eps=1e-5)
            self.attn = CausalSelfAttention()
            self.ln_2 = nn.LayerNorm(width, eps=1e-5)
            self.mlp = MLP()

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(vocabulary, width)
            self.wpe = nn.Embedding(context, width)
            self.h = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(width, eps=1e-5)
            self.register_buffer("pos", torch.arange(context), persistent=False)
            # GPT-2 initialization (fedmesh's TokenEmbedding / TransformerBlock::initialize).
            nn.init.normal_(self.wte.weight, mean=0.0, std=0.02)
            nn.init.normal_(self.wpe.weight, mean=0.0, std=0.01)
            residual_std = 0.02 / math.sqrt(2 * layers)
            for name, module in self.named_modules():
                if isinstance(module, nn.Linear):
                    std = residual_std if name.endswith("c_proj") else 0.02
                    nn.init.normal_(module.weight, mean=0.0, std=std)
                    nn.init.zeros_(module.bias)
                # nn.LayerNorm already starts at weight 1, bias 0

        def forward(self, idx, targets=None):
            B, T = idx.shape
            x = self.wte(idx) + self.wpe(self.pos[:T])
            for block in self.h:
                x = block(x)
            x = self.ln_f(x)
            logits = F.linear(x, self.wte.weight)  # tied output projection, no bias
            if targets is None:
                return logits, None
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
            return logits, loss

    return GPT(), ("scaled_dot_product_attention" if has_sdpa else "manual (masked_fill + softmax)")


# ----------------------------------------------------------------------------
# The same start as fedmesh: weights in fedmesh's names, fedmesh's shuffle
# ----------------------------------------------------------------------------

def fedmesh_name(torch_name):
    """h.3.attn.c_attn.weight -> h3.attn.c_attn.weight; the rest as they are."""
    parts = torch_name.split(".")
    if len(parts) > 2 and parts[0] == "h" and parts[1].isdigit():
        return "h" + parts[1] + "." + ".".join(parts[2:])
    return torch_name


def hf_gpt2_state(model, context, layers):
    """The model's weights as Hugging Face's GPT2LMHeadModel.state_dict() holds
    them: transformer.* names, Conv1D weights as (in, out), each block's
    causal-mask buffer attn.bias (1, 1, context, context), lm_head.weight
    (tied: wte's values)."""
    import torch
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    out = []
    for name, p in model.named_parameters():
        t = p.detach()
        if name.startswith("h.") and name.split(".", 2)[2] in conv1d:
            t = t.t().contiguous()
        out.append(("transformer." + name, t))
    mask = torch.tril(torch.ones(context, context)).view(1, 1, context, context)
    out += [(f"transformer.h.{i}.attn.bias", mask) for i in range(layers)]
    out.append(("lm_head.weight", model.wte.weight.detach()))
    return out


def write_safetensors(path, named):
    """named: [(name, float32 CPU tensor)] -> a safetensors file (no package needed)."""
    import ctypes
    header, offset, blobs = {}, 0, []
    for name, t in named:
        t = t.detach().to("cpu", dtype=__import__("torch").float32).contiguous()
        size = t.numel() * 4
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        blobs.append((t, size))
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for t, size in blobs:
            f.write(ctypes.string_at(t.data_ptr(), size))
    os.replace(tmp, path)


def read_safetensors(path):
    """{name: float32 tensor} of a safetensors file whose tensors are F32."""
    import torch
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        sys.exit(f"torch_gpt.py: --init {path}: not a safetensors file (too short)")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        sys.exit(f"torch_gpt.py: --init {path}: its header claims {n} bytes, the file has {len(data) - 8}")
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info.get("dtype") != "F32":
            sys.exit(f"torch_gpt.py: --init {path}: {name} is {info.get('dtype')}, not F32")
        begin, end = info["data_offsets"]
        count = (end - begin) // 4
        out[name] = torch.frombuffer(bytearray(data[base + begin:base + end]), dtype=torch.float32,
                                     count=count).view(info["shape"]) if count else torch.zeros(info["shape"])
    return out


def from_hf_gpt2(weights):
    """Hugging Face's GPT-2 state dict (`fedmesh checkpoint export --format
    hf-gpt2`) in fedmesh's names and layout: prefix off, h.N -> hN, Conv1D
    weights transposed, mask buffers and the tied lm_head dropped."""
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    out = {}
    for name, t in weights.items():
        if name.startswith("transformer."):
            name = name[len("transformer."):]
        if name == "lm_head.weight":
            continue
        parts = name.split(".", 2)
        if parts[0] == "h" and len(parts) == 3 and parts[1].isdigit():
            if parts[2] in ("attn.bias", "attn.masked_bias"):
                continue
            if parts[2] in conv1d:
                t = t.t().contiguous()
            name = "h" + parts[1] + "." + parts[2]
        out[name] = t
    return out


def load_fedmesh_weights(model, path):
    import torch
    weights = read_safetensors(path)
    if any(name.startswith("transformer.") for name in weights):  # Hugging Face's layout
        weights = from_hf_gpt2(weights)
    expected = {fedmesh_name(name): p for name, p in model.named_parameters()}
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing or extra:
        sys.exit(f"torch_gpt.py: --init {path}: missing {missing[:5]}, not of this model {extra[:5]}")
    with torch.no_grad():
        for name, p in expected.items():
            if tuple(weights[name].shape) != tuple(p.shape):
                sys.exit(f"torch_gpt.py: --init {path}: {name} is {tuple(weights[name].shape)}, "
                         f"the model's is {tuple(p.shape)}")
            p.copy_(weights[name])


class FedmeshShuffle:
    """fedmesh's epoch order (train/trainer.cpp): one xoshiro256** generator
    (base/random.h) seeded with seed ^ 0x5eed5eed5eed through splitmix64,
    each epoch a Fisher-Yates pass over 0..n-1 with Lemire's unbiased
    below(); the generator runs on from one epoch to the next."""
    MASK = (1 << 64) - 1

    def __init__(self, seed):
        x = (seed ^ 0x5eed5eed5eed) & self.MASK
        self.s = []
        for _ in range(4):
            x = (x + 0x9e3779b97f4a7c15) & self.MASK
            z = x
            z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) & self.MASK
            z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & self.MASK
            self.s.append(z ^ (z >> 31))

    @staticmethod
    def _rotl(x, k):
        return ((x << k) | (x >> (64 - k))) & FedmeshShuffle.MASK

    def next_u64(self):
        s, M = self.s, self.MASK
        result = (self._rotl((s[1] * 5) & M, 7) * 9) & M
        t = (s[1] << 17) & M
        s[2] ^= s[0]
        s[3] ^= s[1]
        s[1] ^= s[2]
        s[0] ^= s[3]
        s[2] ^= t
        s[3] = self._rotl(s[3], 45)
        return result

    def below(self, bound):
        m = self.next_u64() * bound
        low = m & self.MASK
        if low < bound:
            threshold = ((1 << 64) - bound) % bound
            while low < threshold:
                m = self.next_u64() * bound
                low = m & self.MASK
        return m >> 64

    def permutation(self, n):
        order = list(range(n))
        for i in range(n, 1, -1):
            j = self.below(i)
            order[i - 1], order[j] = order[j], order[i - 1]
        return order


def evaluate(model, x, y, batch_size, rt):
    import torch
    from torch.nn import functional as F
    model.eval()
    loss_sum = 0.0
    count = 0
    with torch.no_grad():
        for i in range(0, x.shape[0], batch_size):
            xb = x[i:i + batch_size].to(rt.device)
            yb = y[i:i + batch_size].to(rt.device)
            with rt.autocast():
                logits, _ = model(xb)
            loss_sum += F.cross_entropy(logits.float().view(-1, logits.size(-1)), yb.reshape(-1),
                                        reduction="sum").item()
            count += yb.numel()
    model.train()
    return loss_sum / count


def main():
    args = parse_args()
    configure_thread_env(args)
    import_torch_or_reexec(__file__)

    import torch

    rt = Runtime(args, "torch_gpt.py")
    on_cuda = args.device == "cuda"
    torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set / parallel work already started
        pass
    torch.manual_seed(args.seed)

    def log(msg):
        if args.verbose:
            print(f"[torch_gpt] {msg}", file=sys.stderr, flush=True)

    vocabulary, context, width, heads, layers = CONFIGS[args.model]
    eval_batch_size = args.eval_batch_size or max(1, min(256, (1 << 30) // (context * vocabulary)))

    t_load = time.perf_counter()
    train_bytes, held_out_bytes = split_books(load_bible_books())
    x_train, y_train = windows(train_bytes, context, context)
    x_test = y_test = None
    if not args.no_eval:
        if args.test_limit > 0:  # fedmesh: the first limit * context + 1 held-out tokens
            held_out_bytes = held_out_bytes[:args.test_limit * context + 1]
        x_test, y_test = windows(held_out_bytes, context, context)
    log(f"{len(train_bytes)} training bytes -> {x_train.shape[0]} windows of {context}; "
        f"{len(held_out_bytes)} held-out bytes ({time.perf_counter() - t_load:.2f}s)")

    model, attention_impl = build_model(vocabulary, context, width, heads, layers)
    if args.write_init:
        if args.init_layout == "hf-gpt2":
            write_safetensors(args.write_init, hf_gpt2_state(model, context, layers))
        else:
            write_safetensors(args.write_init, [(fedmesh_name(n), p) for n, p in model.named_parameters()])
        print(f"[torch_gpt] wrote the initial weights of {args.model} (seed {args.seed}) to {args.write_init}",
              file=sys.stderr, flush=True)
        return
    if args.init:
        load_fedmesh_weights(model, args.init)
    model = model.to(rt.device)
    parameters = sum(p.numel() for p in model.parameters())
    fpt = flops_per_token(parameters, context, width, layers)
    log(f"{args.model}: {parameters} parameters, attention: {attention_impl}; device {args.device} "
        f"({rt.device_name}), precision {args.precision}, "
        f"{'torch.compile mode ' + rt.compile_mode if rt.compiled else 'eager'}, "
        f"{args.warmup_steps} warm-up step(s)")
    train_model = rt.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                                  weight_decay=args.weight_decay)
    generator = torch.Generator().manual_seed(args.seed)
    fedmesh_order = FedmeshShuffle(args.seed) if args.order == "fedmesh" else None
    if on_cuda:  # the tokenized windows live on the GPU; batches are gathered there
        x_train, y_train = x_train.to(rt.device), y_train.to(rt.device)

    train_count = x_train.shape[0]
    steps_per_epoch = (train_count + args.batch_size - 1) // args.batch_size
    total_steps = args.steps
    warmup = args.warmup_steps
    tail = train_count % args.batch_size  # size of each epoch's last, smaller batch (0: none)

    def precompile_tail():
        """--compile, dynamic=False: compile the short last batch's shape before
        timing (forward + backward, gradients dropped, weights untouched)."""
        with rt.autocast():
            _, loss = train_model(x_train[:tail], y_train[:tail])
        loss.backward()
        optimizer.zero_grad(set_to_none=True)

    model.train()
    step = 0
    timed_tokens = 0
    t_start = time.perf_counter()
    t0 = t_prev = None
    warmup_seconds = None
    step_times = []
    first_loss = last_loss = None
    epoch = 0
    while step < total_steps:
        epoch += 1
        if fedmesh_order is not None:
            order = torch.tensor(fedmesh_order.permutation(train_count), dtype=torch.int64)
        else:
            order = torch.randperm(train_count, generator=generator)
        if on_cuda:
            order = order.to(rt.device)
        for begin in range(0, train_count, args.batch_size):
            index = order[begin:begin + args.batch_size]
            xb, yb = x_train[index], y_train[index]
            optimizer.zero_grad(set_to_none=True)
            with rt.autocast():
                _, loss = train_model(xb, yb)
            rt.backward_and_step(loss, optimizer)
            step += 1
            if args.log_every and (step % args.log_every == 0 or step == total_steps):
                log(f"step {step}/{total_steps}: loss {loss.item():.4f}")  # .item() syncs; off by default
            if step == 1:
                first_loss = loss.item()  # also syncs
            if step < warmup:
                pass
            elif step == warmup:
                if rt.compiled and tail and total_steps >= steps_per_epoch and warmup < steps_per_epoch:
                    precompile_tail()
                rt.synchronize()
                t0 = t_prev = time.perf_counter()  # timing starts after the warm-up
                warmup_seconds = t0 - t_start
            else:
                timed_tokens += yb.numel()
                if not on_cuda:  # a per-step timer read would need a sync on cuda
                    t_now = time.perf_counter()
                    step_times.append(t_now - t_prev)  # includes assembling the batch
                    t_prev = t_now
            if step >= total_steps:
                break
    rt.synchronize()
    train_seconds = time.perf_counter() - t0
    last_loss = loss.item()
    timed_steps = step - warmup
    tps = timed_tokens / train_seconds if train_seconds > 0 else None
    log(f"{step} steps ({epoch} epoch(s) of {steps_per_epoch} steps), {timed_tokens} timed tokens in "
        f"{train_seconds:.3f}s -> {tps:.1f} tokens/s, loss {first_loss:.4f} -> {last_loss:.4f}")

    median_step_ms, p90_step_ms, mean_step_ms, compile_seconds = timing_report(
        log, rt, step_times, train_seconds, timed_steps, warmup, warmup_seconds, on_cuda)

    # MFU: against --peak-flops, else the table's dense bf16 peak of this GPU.
    if args.peak_flops is not None:
        peak, peak_source = args.peak_flops, "--peak-flops"
    elif on_cuda:
        peak, key = peak_flops_for(rt.device_name)
        peak_source = f"table: {key} dense bf16" if key else f"unknown: '{rt.device_name}' is not in the table"
    else:
        peak, peak_source = None, "unknown: no --peak-flops on cpu"
    mfu = tps * fpt / peak if (peak and tps) else None
    if on_cuda or args.peak_flops is not None:
        achieved = f"{tps * fpt / 1e12:.3g} TFLOP/s" if tps else "n/a"
        mfu_text = f"{100 * mfu:.3g}%" if mfu is not None else "unknown"
        print(f"[torch_gpt] MFU {mfu_text} ({achieved} at {fpt / 1e6:.1f} MFLOP/token; peak "
              f"{'%.0f TFLOP/s' % (peak / 1e12) if peak else 'unknown'}, {peak_source})",
              file=sys.stderr, flush=True)

    test_loss = None
    if not args.no_eval:
        t_eval = time.perf_counter()
        test_loss = evaluate(model, x_test, y_test, eval_batch_size, rt)
        log(f"eval: loss {test_loss:.4f} on {x_test.shape[0]} windows ({time.perf_counter() - t_eval:.2f}s)")

    result = {
        "framework": "pytorch",
        "torch_version": torch.__version__,
        "model": args.model,
        "parameters": parameters,
        "vocabulary": vocabulary,
        "context": context,
        "batch_size": args.batch_size,
        "threads": args.threads,
        "tokens_per_second": tps,
        "samples_per_second": tps / context if tps else None,
        "train_seconds": train_seconds,
        "steps": step,
        "timed_steps": timed_steps,
        "timed_tokens": timed_tokens,
        "train_windows": int(train_count),
        "first_train_loss": first_loss,
        "final_train_loss": last_loss,
        "test_loss": test_loss,
        "bits_per_byte": test_loss / math.log(2) if test_loss is not None else None,
        "test_windows": int(x_test.shape[0]) if x_test is not None else None,
        "lr": args.lr,
        "weight_decay": args.weight_decay,
        "attention": attention_impl,
        # Diagnostics for noisy machines: per-step wall time of the timed steps
        # (median/p90: CPU only; mean: timed time / timed steps).
        "median_step_ms": median_step_ms,
        "p90_step_ms": p90_step_ms,
        "mean_step_ms": mean_step_ms,
        "seed": args.seed,
        "init": args.init,
        "order": args.order,
        "openblas_threads": int(os.environ["OPENBLAS_NUM_THREADS"]),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "python": platform.python_version(),
        "warmup_steps": warmup,
        "warmup_seconds": warmup_seconds,
        "compile_seconds": compile_seconds,
        "eval_batch_size": eval_batch_size,
        "flops_per_token": fpt,
        "peak_flops": peak,
        "peak_flops_source": peak_source,
        "mfu": mfu,
    }
    result.update(rt.describe())
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
