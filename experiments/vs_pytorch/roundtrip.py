#!/usr/bin/env python3
"""The PyTorch round trip of dtrain's safetensors weights (issue #54): both directions, on
the PyTorch twins of models.py, for LeNet-5, ResNet-20, AlexNet-CIFAR and the GPT.

  dtrain → PyTorch: dtrain's seeded initial weights (seed 7) are written by dtrain's export
      path (`framework/examples/safetensors_eval.rs init`, the code `dtrain export` uses),
      loaded into the twin with `load_state_dict(strict=True)`, and both evaluate the same
      batch (dtrain's synthetic batch, seed 7, which models.py mirrors): the mean
      cross-entropy must agree to `--rtol` (default 1e-5) relative.
  PyTorch → dtrain: the twin is initialised by PyTorch (`torch.manual_seed(1)`), its
      BatchNorm statistics moved by three training-mode forward passes, saved with
      `safetensors.torch.save_file(model.state_dict())`, loaded by dtrain's `init_from`
      path (`safetensors_eval eval`), and both evaluate the batch again.

Both sides evaluate in evaluation mode (no dropout, BatchNorm on running statistics).
Needs torch and safetensors (see README.md, "Install") and the example built:

    cargo build -p dtrain-framework --example safetensors_eval
    python experiments/vs_pytorch/roundtrip.py [--example target/debug/examples/safetensors_eval]

Prints one line per model and direction; exit status 1 when one disagrees.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from torch.nn import functional as F
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402  (the twins, beside this file)

MODELS = ["lenet/lenet5", "resnet/resnet20", "alexnet/cifar", "gpt/mini", "lstm/word", "mlp/mnist",
          "vgg/vgg11"]
# --torchvision: dtrain's ImageNet models against torchvision's own modules (batch of 2).
TORCHVISION = {
    "resnet/resnet18": "resnet18",
    "resnet/resnet34": "resnet34",
    "resnet/resnet50": "resnet50",
    "alexnet/imagenet": "alexnet",
    "vgg/vgg11:head=imagenet": "vgg11",
}
# Not vgg11_bn: dtrain's VGG with BatchNorm has no convolution biases (the twin's neither),
# torchvision's vgg*_bn has them, so its state_dict has 8 tensors more (models/README.md).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def dtrain(example: str, *args: str) -> str:
    out = subprocess.run([example, *args], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{example} {' '.join(args)}: exit {out.returncode}: {out.stderr.strip()}")
    return out.stdout


def resolve(name: str) -> models.Twin:
    """The twin of `name`, or torchvision's module for the ImageNet models."""
    if name in TORCHVISION:
        import torchvision

        build = getattr(torchvision.models, TORCHVISION[name])
        return models.Twin(lambda: build(weights=None), ("images", 3, 224, 224, 1000), None,
                           f"torchvision.models.{TORCHVISION[name]}")
    return models.resolve(name)


def torch_loss(name: str, model: torch.nn.Module, batch: int, seq_len: int) -> float:
    twin = resolve(name)
    inputs, targets = models.synthetic_batch(twin, batch, seq_len, 7, "dtrain")
    model.eval()
    with torch.no_grad():
        if twin.is_language_model:
            logits, _ = model(inputs)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        else:
            loss = F.cross_entropy(model(inputs), targets)
    return float(loss)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    p.add_argument("--example", default=os.path.join(target, "debug", "examples", "safetensors_eval"))
    p.add_argument("--models", nargs="+", default=MODELS)
    p.add_argument("--rtol", type=float, default=1e-5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--torchvision", action="store_true",
                   help="also ResNet-18/34/50, AlexNet and VGG-11 (ImageNet head) against "
                        "torchvision's modules, batch of 2 (needs torchvision)")
    args = p.parse_args()
    if args.torchvision:
        args.models += list(TORCHVISION)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}; dtrain: {args.example}; batch: dtrain's synthetic, seed 7")
    print(f"{'model':<42} {'direction':<18} {'dtrain loss':>14} {'pytorch loss':>14} {'rel diff':>10}")
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            twin = resolve(name)
            batch, seq_len = (20, 35) if twin.is_language_model else (32, 35)
            if name in TORCHVISION:
                batch = 2
            rows = []
            # dtrain → PyTorch
            a = os.path.join(tmp, "dtrain.safetensors")
            dtrain(args.example, name, "init", a)
            ours = json.loads(dtrain(args.example, name, "eval", a, str(batch), str(seq_len)))["loss"]
            model = twin.build()
            model.load_state_dict(load_file(a), strict=True)
            rows.append(("dtrain -> pytorch", ours, torch_loss(name, model, batch, seq_len)))
            # PyTorch → dtrain
            torch.manual_seed(1)
            model = twin.build()
            model.train()
            with torch.no_grad():
                for s in range(3):
                    x, _ = models.synthetic_batch(twin, batch, seq_len, 100 + s, "normal")
                    model(x)
            b = os.path.join(tmp, "pytorch.safetensors")
            save_file({k: v.contiguous() for k, v in model.state_dict().items()}, b)
            theirs = torch_loss(name, model, batch, seq_len)
            ours = json.loads(dtrain(args.example, name, "eval", b, str(batch), str(seq_len)))["loss"]
            rows.append(("pytorch -> dtrain", ours, theirs))
            for direction, d, t in rows:
                rel = abs(d - t) / max(abs(t), 1e-30)
                ok = rel <= args.rtol
                failed += not ok
                print(f"{name:<42} {direction:<18} {d:>14.8f} {t:>14.8f} {rel:>10.2e}"
                      f"{'' if ok else '  FAIL'}", flush=True)
    print("ok" if not failed else f"{failed} disagreement(s) above {args.rtol:g}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
