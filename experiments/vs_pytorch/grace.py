#!/usr/bin/env python3
"""GRACE's PyTorch compressors timed on a raw f32 vector, the way `dtrain bench compress
--from FILE` times dtrain's on the same file, for the side-by-side of `grace.sh`.

GRACE (Xu et al., "GRACE: A Compressed Communication Framework for Distributed Machine
Learning", ICDCS 2021; github.com/sands-lab/grace) is not on PyPI: point `--grace` (or
`GRACE_DIR`) at a checkout of it. Only its `grace_dl/torch` compressors are imported.

For each method the vector is compressed (`compress`) and the payload decompressed
(`decompress`), `--repeat` times after one untimed call; the best times are reported as GB/s
of f32 input (4 bytes per element), like dtrain's bench. No error-feedback memory (dtrain's
bench without `--error-feedback`). One thread unless `--threads` says otherwise.
"""

import argparse
import importlib
import json
import os
import sys
import time

import torch

# dtrain's `bench compress` spec → (GRACE module, class, constructor arguments). The
# parameters are dtrain's spec's: top-k's and DGC's ratio, the threshold τ.
METHODS = {
    "topk:ratio=0.01": ("topk", "TopKCompressor", {"compress_ratio": 0.01}),
    "dgc:ratio=0.001": ("dgc", "DgcCompressor", {"compress_ratio": 0.001}),
    "threshold:tau=0.02": ("threshold", "ThresholdCompressor", {"threshold": 0.02}),
    "terngrad": ("terngrad", "TernGradCompressor", {}),
    "onebit": ("onebit", "OneBitCompressor", {}),
}


def load(grace: str, spec: str):
    module, cls, kwargs = METHODS[spec]
    if grace not in sys.path:
        sys.path.insert(0, grace)
    mod = importlib.import_module(f"grace_dl.torch.compressor.{module}")
    return getattr(mod, cls)(**kwargs)


def best(f, repeat: int) -> float:
    f()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(grace: str, spec: str, x: torch.Tensor, repeat: int) -> dict:
    c = load(grace, spec)
    name = "bench"
    out = {}
    comp = best(lambda: out.__setitem__("p", c.compress(x, name)), repeat)
    payload, ctx = out["p"]
    dec = best(lambda: c.decompress(payload, ctx), repeat)
    gb = 4 * x.numel() / 1e9
    return {"method": spec, "compress_gbps": gb / comp, "decompress_gbps": gb / dec,
            "compress_ms": comp * 1e3, "decompress_ms": dec * 1e3}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--grace", default=os.environ.get("GRACE_DIR"),
                   help="a checkout of github.com/sands-lab/grace (default $GRACE_DIR)")
    p.add_argument("--from", dest="path", required=True, help="raw little-endian f32 file")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated, of: {', '.join(METHODS)}")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not args.grace or not os.path.isdir(os.path.join(args.grace, "grace_dl", "torch")):
        p.error(f"--grace {args.grace!r}: not a GRACE checkout (no grace_dl/torch in it)")
    specs = [s for s in args.methods.split(",") if s]
    unknown = [s for s in specs if s not in METHODS]
    if unknown:
        p.error(f"unknown method(s) {', '.join(unknown)}; known: {', '.join(METHODS)}")
    torch.set_num_threads(args.threads)
    data = open(args.path, "rb").read()
    if len(data) % 4:
        p.error(f"{args.path}: {len(data)} bytes is not a whole number of f32 values")
    x = torch.frombuffer(bytearray(data), dtype=torch.float32)
    rows = [measure(args.grace, s, x, args.repeat) for s in specs]
    if args.json:
        print(json.dumps({"framework": f"GRACE on PyTorch {torch.__version__}",
                          "elements": x.numel(), "threads": args.threads, "results": rows}))
    else:
        for r in rows:
            print(f"{r['method']:20} compress {r['compress_gbps']:.3f} GB/s, "
                  f"decompress {r['decompress_gbps']:.3f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
