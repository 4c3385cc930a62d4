#!/usr/bin/env python3
"""PyTorch twins of the models that `dtrain bench models` times.

`dtrain bench models` (framework/src/bench/models.rs) times one training step of each model
on the CPU: the forward pass with the loss (and the loss and accuracy read back), then the
backward pass with every gradient copied into one flat buffer; no optimizer. This script
builds the same six architectures in PyTorch and times the same step the same way, so that
the two frameworks can be compared on one machine at one thread count:

    RAYON_NUM_THREADS=1 dtrain bench models --models resnet/resnet20,mlp/mnist
    python experiments/vs_pytorch/models.py --threads 1 --models resnet/resnet20,mlp/mnist

What is mirrored, and from where:

- architectures: models/src/{mlp,lenet,alexnet,vgg,resnet,lstm,layers}.rs, at the defaults
  that models/src/registry.rs resolves each `kind/variant` to (each class names its file);
  the parameter counts equal dtrain's (checked at run time and by test_models.py);
- the step: forward + mean cross-entropy (per token for the LSTM, over batch × sequence)
  + reading back the loss and the top-1 count (dtrain's metrics), then backward +
  copying every gradient into one preallocated flat f32 tensor; models in training mode
  (dropout on, BatchNorm on batch statistics); the LSTM carries its detached state from
  one step into the next, as dtrain's truncated BPTT does;
- the batch: 32 images or 20 sequences of 35 tokens (vocabulary 10,000), and by default
  the very values dtrain draws (its xorshift64 generator, seed 7: pixels uniform in
  [-1, 1), uniform labels / tokens); `--data normal` draws from torch instead;
- the timing: the first step timed alone; `warmup - 1` more untimed steps; then `steps`
  timed steps, reporting the medians of forward, backward and their per-step sum;
- the output: the same table columns, or with `--json` the same field names as dtrain's
  `--json` (`model`, `params`, `batch`, `dropout_off`, `timing.{device, first_ms, step_ms,
  forward_ms, backward_ms}`, `reference`, `check`).

Not mirrored: initial weights (PyTorch's default initialisers; step time does not depend on
them) and the random dropout masks.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable

with warnings.catch_warnings():
    # torch wheels warn on import when NumPy is absent; nothing here uses NumPy.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch
    from torch import nn
    from torch.nn import functional as F


# --------------------------------------------------------------------------------------
# Architectures
# --------------------------------------------------------------------------------------


def conv(c_in: int, c_out: int, kernel: int, stride: int, padding: int, bias: bool) -> nn.Conv2d:
    """Square convolution with symmetric zero padding (dtrain: `layers::conv`)."""
    return nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=padding, bias=bias)


class Mlp(nn.Module):
    """Mirrors models/src/mlp.rs, variant `mnist`: 784-512-256-10, ReLU after each hidden
    layer followed by dropout (0 for `mnist`, so no dropout at all, as burn skips p = 0)."""

    def __init__(self, in_channels=1, image_size=28, hidden=(512, 256), num_classes=10, dropout=0.0):
        super().__init__()
        widths = [in_channels * image_size * image_size, *hidden, num_classes]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.flatten(1)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < last:
                x = self.dropout(F.relu(x))
        return x


class LeNet5(nn.Module):
    """Mirrors models/src/lenet.rs, variant `lenet5`: conv 5×5 → 6 (padding 2), ReLU, 2×2 max
    pool; conv 5×5 → 16 (no padding), ReLU, 2×2 max pool; 400-120-84-10 with ReLU."""

    def __init__(self, in_channels=1, image_size=28, num_classes=10):
        super().__init__()
        side = (image_size // 2 - 4) // 2
        self.conv1 = conv(in_channels, 6, 5, 1, 2, True)
        self.conv2 = conv(6, 16, 5, 1, 0, True)
        self.fc1 = nn.Linear(16 * side * side, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(images)), 2, 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2, 2)
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class AlexNetCifar(nn.Module):
    """Mirrors models/src/alexnet.rs, variant `cifar` (no LRN): five convolutions
    (64 11×11/4 pad 5, 192 5×5 pad 2, 384 3×3, 256 3×3, 256 3×3; each with bias and ReLU), a
    2×2/2 max pool after convolutions 1, 2 and 5 (32 → 8 → 4 → 2 → 1), then one linear layer
    256 → 10. Dropout (0.5) only precedes hidden linear layers, which `cifar` has none of."""

    # (out channels, kernel, stride, padding): alexnet.rs `CIFAR_CONVS`.
    CONVS = [(64, 11, 4, 5), (192, 5, 1, 2), (384, 3, 1, 1), (256, 3, 1, 1), (256, 3, 1, 1)]
    POOL_AFTER = (0, 1, 4)

    def __init__(self, in_channels=3, image_size=32, num_classes=10):
        super().__init__()
        layers, c_in, side = [], in_channels, image_size
        for i, (c_out, k, s, p) in enumerate(self.CONVS):
            layers.append(conv(c_in, c_out, k, s, p, True))
            c_in = c_out
            side = (side + 2 * p - k) // s + 1
            if i in self.POOL_AFTER:
                side = (side - 2) // 2 + 1
        self.features = nn.ModuleList(layers)
        self.classifier = nn.Linear(256 * side * side, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images
        for i, layer in enumerate(self.features):
            x = F.relu(layer(x))
            if i in self.POOL_AFTER:
                x = F.max_pool2d(x, 2, 2)
        return self.classifier(x.flatten(1))


class Vgg(nn.Module):
    """Mirrors models/src/vgg.rs with the registry's defaults for `vgg/<depth>`: CIFAR head,
    no BatchNorm (so every 3×3 convolution, padding 1, has a bias), ReLU after each, 2×2/2
    max pools where the table has a 0, then one linear layer 512 → 10 on the 1×1 map. The
    CIFAR head has no hidden layers, so no dropout runs."""

    # Convolution widths; 0 marks a 2×2 max pool (vgg.rs `VggDepth::layers`).
    LAYERS = {
        "vgg11": [64, 0, 128, 0, 256, 256, 0, 512, 512, 0, 512, 512, 0],
        "vgg13": [64, 64, 0, 128, 128, 0, 256, 256, 0, 512, 512, 0, 512, 512, 0],
        "vgg16": [64, 64, 0, 128, 128, 0, 256, 256, 256, 0, 512, 512, 512, 0, 512, 512, 512, 0],
        "vgg19": [64, 64, 0, 128, 128, 0, 256, 256, 256, 256, 0,
                  512, 512, 512, 512, 0, 512, 512, 512, 512, 0],
    }

    def __init__(self, depth="vgg11", batch_norm=False, in_channels=3, image_size=32, num_classes=10):
        super().__init__()
        features, norms, pool_after = [], [], []
        c_in = in_channels
        for width in self.LAYERS[depth]:
            if width == 0:
                pool_after[-1] = True
                continue
            features.append(conv(c_in, width, 3, 1, 1, not batch_norm))
            if batch_norm:
                norms.append(nn.BatchNorm2d(width))
            pool_after.append(False)
            c_in = width
        self.features = nn.ModuleList(features)
        self.norms = nn.ModuleList(norms)
        self.pool_after = pool_after
        side = image_size // 32
        self.classifier = nn.Linear(512 * side * side, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images
        for i, layer in enumerate(self.features):
            x = layer(x)
            if i < len(self.norms):
                x = self.norms[i](x)
            x = F.relu(x)
            if self.pool_after[i]:
                x = F.max_pool2d(x, 2, 2)
        return self.classifier(x.flatten(1))


class BasicBlock(nn.Module):
    """Mirrors `Block` of models/src/resnet.rs (basic kind, option-A shortcut): conv 3×3
    (stride) → BN → ReLU → conv 3×3 → BN, plus the shortcut, then ReLU. Where the shape
    changes, the shortcut is the identity subsampled with stride 2 (dtrain: a 1×1 max pool
    with stride 2, i.e. every other row and column) and zero-padded with (c_out − c_in) / 2
    channels before and after; it has no parameters."""

    def __init__(self, c_in: int, width: int, stride: int):
        super().__init__()
        self.conv1 = conv(c_in, width, 3, stride, 1, False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = conv(width, width, 3, 1, 1, False)
        self.bn2 = nn.BatchNorm2d(width)
        reshapes = stride != 1 or c_in != width
        self.subsample = stride if reshapes else 1
        self.pad_channels = (width - c_in) // 2 if reshapes else 0

    def shortcut(self, x: torch.Tensor) -> torch.Tensor:
        if self.subsample != 1:
            x = x[:, :, :: self.subsample, :: self.subsample]
        if self.pad_channels > 0:
            # F.pad's last pair pads dimension 1 (channels): zeros before and after.
            x = F.pad(x, (0, 0, 0, 0, self.pad_channels, self.pad_channels))
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = self.shortcut(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + identity)


class CifarResNet(nn.Module):
    """Mirrors models/src/resnet.rs, CIFAR ResNets of depth 6n + 2 (`resnet20`: n = 3):
    3×3 convolution → 16 (no bias) → BN → ReLU; three stages of n basic blocks at 16, 32 and
    64 channels, the first block of stages 2 and 3 with stride 2 and an option-A shortcut;
    global average pooling; linear 64 → 10. BatchNorm has PyTorch's defaults in both."""

    def __init__(self, depth=20, in_channels=3, num_classes=10, base_width=16):
        super().__init__()
        if depth < 8 or (depth - 2) % 6:
            raise ValueError(f"CIFAR ResNet depth must be 6n+2, got {depth}")
        n = (depth - 2) // 6
        self.conv1 = conv(in_channels, base_width, 3, 1, 1, False)
        self.bn1 = nn.BatchNorm2d(base_width)
        blocks, c_in = [], base_width
        for s in range(3):
            width = base_width << s
            for b in range(n):
                blocks.append(BasicBlock(c_in, width, 2 if s > 0 and b == 0 else 1))
                c_in = width
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(c_in, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(images)))
        x = self.blocks(x)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


class LstmLm(nn.Module):
    """Mirrors models/src/lstm.rs, variant `word`: embedding (vocab × 200) → dropout → two
    LSTM layers of 200 (batch first, biases on both the input and the hidden transform, as
    burn's `LstmConfig::new(d_in, hidden, true)`), dropout after each → linear decoder tied
    to the embedding (logits = h · Eᵀ + b, with its own bias of `vocab`). Dropout 0.2 runs on
    the embedding output and on the output of every layer, three times in all.

    One single-layer `nn.LSTM` per layer, as dtrain has one burn `Lstm` per layer, so the
    dropout sites are explicit; a two-layer `nn.LSTM(dropout=0.2)` followed by dropout
    computes the same function."""

    def __init__(self, vocab=10_000, embed=200, hidden=200, layers=2, dropout=0.2, tied=True):
        super().__init__()
        if tied and embed != hidden:
            raise ValueError(f"tied weights need embed == hidden, got {embed} and {hidden}")
        self.embedding = nn.Embedding(vocab, embed)
        self.layers = nn.ModuleList(
            nn.LSTM(embed if i == 0 else hidden, hidden, batch_first=True) for i in range(layers)
        )
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.tied = tied
        if tied:
            self.decoder_bias = nn.Parameter(torch.zeros(vocab))
        else:
            self.decoder = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor, state=None):
        """`tokens` `[batch, seq]`, `state` one `(h, c)` per layer or None (zeros); returns
        logits `[batch, seq, vocab]` and the new state."""
        x = self.dropout(self.embedding(tokens))
        new_state = []
        for i, layer in enumerate(self.layers):
            x, s = layer(x, None if state is None else state[i])
            x = self.dropout(x)
            new_state.append(s)
        if self.tied:
            logits = F.linear(x, self.embedding.weight, self.decoder_bias)
        else:
            logits = self.decoder(x)
        return logits, new_state


class GptAttention(nn.Module):
    """Mirrors `CausalSelfAttention` of models/src/gpt.rs: separate query, key, value and
    output projections (with biases), scaled dot-product attention over `heads` heads with a
    causal mask, dropout on the attention weights."""

    def __init__(self, d_model: int, heads: int, dropout: float):
        super().__init__()
        self.query = nn.Linear(d_model, d_model)
        self.key = nn.Linear(d_model, d_model)
        self.value = nn.Linear(d_model, d_model)
        self.output = nn.Linear(d_model, d_model)
        self.attention_dropout = nn.Dropout(dropout)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.heads
        split = lambda y: y.reshape(b, t, h, d // h).transpose(1, 2)
        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scores = q @ k.transpose(2, 3) / math.sqrt(d // h)
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        weights = self.attention_dropout(F.softmax(scores.masked_fill(future, float("-inf")), dim=3))
        return self.output((weights @ v).transpose(1, 2).reshape(b, t, d))


class GptMlp(nn.Module):
    """Mirrors `GptMlp`: `fc` → GELU (tanh form) → `proj`."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.fc = nn.Linear(d_model, hidden)
        self.proj = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class GptBlock(nn.Module):
    """Mirrors `GptBlock`: pre-LayerNorm attention and MLP, each added back through dropout."""

    def __init__(self, d_model: int, heads: int, mlp_ratio: int, dropout: float):
        super().__init__()
        self.attention_norm = nn.LayerNorm(d_model)
        self.attention = GptAttention(d_model, heads, dropout)
        self.mlp_norm = nn.LayerNorm(d_model)
        self.mlp = GptMlp(d_model, mlp_ratio * d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.attention_norm(x)))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class Gpt(nn.Module):
    """Mirrors models/src/gpt.rs, variant `mini` (4 layers, 256 wide, 4 heads, 256
    positions, MLP ratio 4, dropout 0.1): token + learned position embeddings → dropout →
    pre-LayerNorm blocks → final LayerNorm → logits through the tied token embedding (no
    output bias). Module names are dtrain's, so an exported file loads with strict=True.
    Returns `(logits, None)`: nothing is carried between batches."""

    def __init__(self, vocab=10_000, context=256, d_model=256, heads=4, layers=4, mlp_ratio=4,
                 dropout=0.1):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, d_model)
        self.position_embedding = nn.Embedding(context, d_model)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(GptBlock(d_model, heads, mlp_ratio, dropout) for _ in range(layers))
        self.final_norm = nn.LayerNorm(d_model)

    def forward(self, tokens: torch.Tensor, state=None):
        t = tokens.shape[1]
        x = self.dropout(self.token_embedding(tokens) + self.position_embedding.weight[:t])
        for block in self.blocks:
            x = block(x)
        return F.linear(self.final_norm(x), self.token_embedding.weight), None


# --------------------------------------------------------------------------------------
# The registry of twins
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Twin:
    """One `kind/variant` of dtrain and its PyTorch twin."""

    build: Callable[[], nn.Module]
    # ("images", channels, height, width, num_classes) or ("tokens", vocab).
    input: tuple
    # dtrain's `model.table().num_params()` for this spec.
    dtrain_params: int
    # The dtrain file the twin mirrors.
    mirrors: str
    # dtrain's `:key=value` options the twin mirrors: keyword arguments of `build`. Those
    # named like the input (`in_channels`, `image_size`, `num_classes`) also reshape it.
    options: tuple = ()

    @property
    def is_language_model(self) -> bool:
        return self.input[0] == "tokens"


# dtrain's vocabulary for a language model whose spec names none (bench/models.rs).
DEFAULT_VOCAB = 10_000

# In the order of dtrain's `DEFAULT_MODELS` (framework/src/bench/models.rs).
TWINS: dict[str, Twin] = {
    "mlp/mnist": Twin(Mlp, ("images", 1, 28, 28, 10), 535_818, "models/src/mlp.rs",
                      options=("in_channels", "image_size", "hidden", "num_classes")),
    "lenet/lenet5": Twin(LeNet5, ("images", 1, 28, 28, 10), 61_706, "models/src/lenet.rs"),
    "alexnet/cifar": Twin(AlexNetCifar, ("images", 3, 32, 32, 10), 2_472_266, "models/src/alexnet.rs"),
    "vgg/vgg11": Twin(lambda: Vgg("vgg11"), ("images", 3, 32, 32, 10), 9_225_610, "models/src/vgg.rs"),
    "resnet/resnet20": Twin(lambda: CifarResNet(20), ("images", 3, 32, 32, 10), 269_722,
                            "models/src/resnet.rs"),
    "lstm/word": Twin(lambda: LstmLm(DEFAULT_VOCAB), ("tokens", DEFAULT_VOCAB), 2_653_200,
                      "models/src/lstm.rs"),
}

# Twins outside the default list (named with --models): the GPT of the weights round trip
# (roundtrip.py), which `dtrain bench models --models gpt/mini` times too.
EXTRA_TWINS: dict[str, Twin] = {
    "gpt/mini": Twin(lambda: Gpt(DEFAULT_VOCAB), ("tokens", DEFAULT_VOCAB), 5_785_088,
                     "models/src/gpt.rs"),
}


def split_top_level(text: str, seps: str) -> list[str]:
    """`text` split at each character of `seps` outside brackets (dtrain's
    `split_top_level`): `a,b=[1,2]` → `a`, `b=[1,2]`."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth = max(depth + {"[": 1, "]": -1}.get(c, 0), 0)
        if c in seps and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def parse_options(text: str) -> dict:
    """dtrain's `key=value;key=value` (or `,` between them, outside brackets): values are
    Python literals (`32`, `[2048, 1024]`), anything else a string."""
    options = {}
    for part in filter(str.strip, split_top_level(text, ",;")):
        key, eq, value = part.partition("=")
        if not eq:
            raise ValueError(f"option {part!r} is not key=value")
        try:
            options[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            options[key.strip()] = value.strip()
    return options


def resolve(name: str) -> Twin:
    """The twin of `kind/variant` or `kind/variant:key=value;key=value` (the options it
    mirrors only; its parameter count is then the twin's own, which compare.sh checks
    against dtrain's row). Raises ValueError naming what is unknown."""
    base, _, text = name.partition(":")
    known = {**TWINS, **EXTRA_TWINS}
    if base not in known:
        raise ValueError(f"unknown model {base!r}; known: {', '.join(known)}")
    twin = known[base]
    options = parse_options(text)
    if not options:
        return twin
    unknown = sorted(set(options) - set(twin.options))
    if unknown:
        mirrored = ", ".join(twin.options) or "none"
        raise ValueError(f"{base}: option(s) {', '.join(unknown)} not mirrored by the twin "
                         f"(it takes: {mirrored})")
    shape = list(twin.input)
    if shape[0] == "images":
        for i, key in ((1, "in_channels"), (2, "image_size"), (3, "image_size"), (4, "num_classes")):
            shape[i] = options.get(key, shape[i])
    return Twin(lambda: twin.build(**options), tuple(shape), None, twin.mirrors, twin.options)


def count_params(model: nn.Module) -> int:
    """Trainable parameters (dtrain's `num_params`: BatchNorm running statistics are buffers
    in both frameworks and are not counted)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# --------------------------------------------------------------------------------------
# Synthetic data
# --------------------------------------------------------------------------------------

_MASK64 = (1 << 64) - 1


class SynthRng:
    """dtrain's `SynthRng` (models/src/synthetic.rs): xorshift64, so that the twin sees the
    very batch dtrain's benchmark draws."""

    def __init__(self, seed: int):
        self.state = ((seed * 0x9E3779B97F4A7C15) & _MASK64) | 1

    def next_u64(self) -> int:
        x = self.state
        x ^= (x << 13) & _MASK64
        x ^= x >> 7
        x ^= (x << 17) & _MASK64
        self.state = x
        return x

    def next_f32(self) -> float:
        """Uniform in [-1, 1): 24 random bits / 2²³ − 1 (exact in f32)."""
        return (self.next_u64() >> 40) / float(1 << 23) - 1.0

    def below(self, n: int) -> int:
        return self.next_u64() % n


def synthetic_batch(twin: Twin, batch: int, seq_len: int, seed: int, data: str):
    """`(inputs, targets)`: images `[batch, c, h, w]` f32 and labels `[batch]`, or tokens and
    targets `[batch, seq_len]`; int64 ids. `data` is "dtrain" (dtrain's generator: inputs
    first, then targets) or "normal" (torch: N(0, 1) pixels, uniform ids)."""
    if twin.is_language_model:
        (_, vocab) = twin.input
        shape = (batch, seq_len)
        if data == "dtrain":
            rng = SynthRng(seed)
            n = batch * seq_len
            inputs = [rng.below(vocab) for _ in range(n)]
            targets = [rng.below(vocab) for _ in range(n)]
            return (torch.tensor(inputs, dtype=torch.int64).reshape(shape),
                    torch.tensor(targets, dtype=torch.int64).reshape(shape))
        g = torch.Generator().manual_seed(seed)
        return (torch.randint(vocab, shape, generator=g), torch.randint(vocab, shape, generator=g))
    (_, c, h, w, classes) = twin.input
    shape = (batch, c, h, w)
    if data == "dtrain":
        rng = SynthRng(seed)
        pixels = [rng.next_f32() for _ in range(batch * c * h * w)]
        labels = [rng.below(classes) for _ in range(batch)]
        return (torch.tensor(pixels, dtype=torch.float32).reshape(shape),
                torch.tensor(labels, dtype=torch.int64))
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g), torch.randint(classes, (batch,), generator=g))


def describe_batch(inputs: torch.Tensor, language_model: bool) -> str:
    """dtrain's `SyntheticBatch::describe`: `32x3x32x32`, or `20x35 tokens`."""
    dims = "x".join(str(d) for d in inputs.shape)
    return f"{dims} tokens" if language_model else dims


# --------------------------------------------------------------------------------------
# The training step
# --------------------------------------------------------------------------------------


class Stepper:
    """One model with its batch and flat gradient buffer; `step()` runs dtrain's step
    (`bench::models::step`: `forward_loss`, then `backward_into`)."""

    def __init__(self, twin: Twin, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor):
        self.twin, self.model = twin, model
        self.inputs, self.targets = inputs, targets
        self.params = [p for p in model.parameters() if p.requires_grad]
        # dtrain's caller-owned `grads` buffer, written by every backward.
        self.flat_grads = torch.zeros(sum(p.numel() for p in self.params))
        # Truncated BPTT: the detached state of the previous batch (LmModel::train_state).
        self.state = None
        model.train()

    def forward_loss(self) -> tuple[torch.Tensor, float, int]:
        """Forward with the mean cross-entropy, plus the metrics dtrain reads back inside its
        forward (the loss value and the top-1 count). Returns `(loss, loss value, correct)`."""
        if self.twin.is_language_model:
            logits, state = self.model(self.inputs, self.state)
            # The GPT carries nothing between batches (its state is None).
            self.state = None if state is None else [(h.detach(), c.detach()) for h, c in state]
            b, t, vocab = logits.shape
            logits = logits.reshape(b * t, vocab)
            targets = self.targets.reshape(b * t)
        else:
            logits = self.model(self.inputs)
            targets = self.targets
        loss = F.cross_entropy(logits, targets)
        with torch.no_grad():
            correct = int((logits.argmax(1) == targets).sum())
        return loss, float(loss.detach()), correct

    def backward_into(self, loss: torch.Tensor) -> None:
        """Backward, then every gradient copied into the flat buffer (zeros for a parameter
        the loss does not reach), in parameter order."""
        loss.backward()
        grads = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for p in self.params]
        torch.cat(grads, out=self.flat_grads)

    def step(self) -> tuple[float, float, float]:
        """One step; returns `(loss, forward ms, backward ms)`. Clearing the gradients
        (`set_to_none`, so backward allocates them afresh, like burn) is not timed."""
        self.model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss, value, _ = self.forward_loss()
        t1 = time.perf_counter()
        self.backward_into(loss)
        t2 = time.perf_counter()
        return value, (t1 - t0) * 1e3, (t2 - t1) * 1e3


def make_stepper(name: str, batch: int | None = None, seq_len: int = 35, seed: int = 7,
                 data: str = "dtrain") -> tuple[Stepper, str]:
    """Builds the twin of `name` with weights from `seed` and its synthetic batch; returns the
    stepper and the batch's description. `batch` None: 32 images or 20 sequences."""
    twin = resolve(name)
    torch.manual_seed(seed)
    model = twin.build()
    if batch is None:
        batch = 20 if twin.is_language_model else 32
    inputs, targets = synthetic_batch(twin, batch, seq_len, seed, data)
    return Stepper(twin, model, inputs, targets), describe_batch(inputs, twin.is_language_model)


def measure(name: str, batch: int | None = None, seq_len: int = 35, warmup: int = 2, steps: int = 10,
            seed: int = 7, data: str = "dtrain") -> dict:
    """dtrain's `run_one` without a reference device: the first step timed alone, `warmup - 1`
    untimed steps, then the medians over `steps` timed steps. Returns a row with dtrain's
    JSON field names."""
    stepper, described = make_stepper(name, batch, seq_len, seed, data)
    params = count_params(stepper.model)
    want = resolve(name).dtrain_params
    if want is not None and params != want:
        print(f"warning: {name}: the twin has {params} parameters, dtrain's model {want}",
              file=sys.stderr)
    _, f, b = stepper.step()
    first_ms = f + b
    for _ in range(1, warmup):
        stepper.step()
    fwd, bwd = [], []
    for _ in range(max(steps, 1)):
        _, f, b = stepper.step()
        fwd.append(f)
        bwd.append(b)
    total = [f + b for f, b in zip(fwd, bwd)]
    return {
        "model": name,
        "params": params,
        "batch": described,
        "dropout_off": False,
        "timing": {
            "device": "cpu",
            "first_ms": first_ms,
            "step_ms": statistics.median(total),
            "forward_ms": statistics.median(fwd),
            "backward_ms": statistics.median(bwd),
        },
        "reference": None,
        "check": None,
    }


# --------------------------------------------------------------------------------------
# Output (dtrain's `table_header` / `table_row`)
# --------------------------------------------------------------------------------------


def table_header() -> str:
    return "{:<18} {:>10} {:>16} {:>7} {:>10} {:>9} {:>8} {:>8}".format(
        "model", "params", "batch", "device", "first ms", "step ms", "fwd ms", "bwd ms")


def table_row(row: dict) -> str:
    t = row["timing"]
    return "{:<18} {:>10} {:>16} {:>7} {:>10.1f} {:>9.2f} {:>8.2f} {:>8.2f}".format(
        row["model"], row["params"], row["batch"], t["device"], t["first_ms"], t["step_ms"],
        t["forward_ms"], t["backward_ms"])


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="PyTorch twins of `dtrain bench models`: one training step per model "
                    "(forward + loss, backward + flat gradients; no optimizer) on the CPU.")
    p.add_argument("--models", nargs="+", action="extend", default=[], metavar="MODEL",
                   help="kind/variant, comma- or space-separated, or repeated (default: all: "
                        + ", ".join(TWINS) + ")")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default: torch's own choice); match "
                        "RAYON_NUM_THREADS of the dtrain run")
    p.add_argument("--batch", type=int, default=None,
                   help="examples per batch (default: 32 images, or 20 sequences)")
    p.add_argument("--seq-len", type=int, default=35, help="tokens per sequence (language models)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed steps first (the first step counts as one)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (the median is reported)")
    p.add_argument("--seed", type=int, default=7, help="seed of the batch and the weights (dtrain: 7)")
    p.add_argument("--data", choices=["dtrain", "normal"], default="dtrain",
                   help="dtrain: the batch dtrain draws (xorshift64, uniform [-1, 1)); "
                        "normal: torch.randn images and torch.randint ids")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    # As dtrain's clap option: commas or spaces between names, or the option repeated.
    names = [m.strip() for arg in args.models for m in split_top_level(arg, ", ") if m.strip()]
    for name in names:
        try:
            resolve(name)
        except ValueError as e:
            p.error(str(e))
    args.models = names or list(TWINS)
    for opt in ("threads", "batch", "seq_len"):
        value = getattr(args, opt)
        if value is not None and value < 1:
            p.error(f"--{opt.replace('_', '-')} must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        # Must come before any inter-op parallel work; fails if something already started it.
        torch.set_num_interop_threads(1)
    except RuntimeError as e:
        print(f"warning: interop threads not set: {e}", file=sys.stderr)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if not args.json:
        print(f"pytorch {torch.__version__} twins of dtrain bench models: one training step "
              f"(forward + loss, backward + flat gradients; no optimizer), median of "
              f"{max(args.steps, 1)} after {args.warmup} warm-up, CPU threads: "
              f"{torch.get_num_threads()} (interop {torch.get_num_interop_threads()})")
        print(table_header(), flush=True)
    rows = []
    for name in args.models:
        row = measure(name, args.batch, args.seq_len, args.warmup, args.steps, args.seed, args.data)
        rows.append(row)
        if not args.json:
            print(table_row(row), flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
