#!/usr/bin/env python3
"""CI check of issue #54 (TensorBoard out, safetensors out and in), with TensorBoard's and
safetensors' own Python readers and no torch:

  1. a short LeNet-5 run on MNIST (2 workers, DGC: lenet_mnist_dgc.toml) with
     `output.tensorboard = true` (written by rank 0): its event file is read by
     TensorBoard's EventAccumulator; every scalar series must have one point per logged step
     (per evaluation for `eval/*`) with the value of metrics.jsonl / eval.jsonl (as float32),
     and the configuration text must be the run's;
     the same after the run is resumed for 10 more steps (a second event file);
  2. `dtrain export` of that run, read by the `safetensors` package: the names, shapes and
     dtypes of the PyTorch twin (models.py `LeNet5`), and every value equal to the run's
     final checkpoint (read from its own container format here, burn layout transposed);
  3. a run with `model.init_from` = that file and one step at `train.lr = 1e-30` (lr must be
     > 0; an update of 1e-30·g rounds away on every weight): its final evaluation loss
     equals the first run's exactly;
  4. bad input: a truncated file, another architecture, an unknown --step: exit 1 with one
     line naming the problem.

    python experiments/vs_pytorch/interop_check.py --dtrain target/debug/dtrain --out target/interop

Needs `pip install tensorboard safetensors numpy`; DTRAIN_DATA_DIR with MNIST (dtrain data
fetch mnist). Exit status 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
from safetensors.numpy import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "experiments", "lenet_mnist_dgc.toml")
STEPS = 30
SHORT = [f"train.max_steps={STEPS}", "train.eval_every_steps=15", "data.test_limit=512",
         "data.train_limit=2048"]

# The twin's state_dict (models.py LeNet5) and dtrain's table order (models/src/lenet.rs).
LENET = [("conv1.weight", (6, 1, 5, 5)), ("conv1.bias", (6,)),
         ("conv2.weight", (16, 6, 5, 5)), ("conv2.bias", (16,)),
         ("fc1.weight", (120, 400)), ("fc1.bias", (120,)),
         ("fc2.weight", (84, 120)), ("fc2.bias", (84,)),
         ("fc3.weight", (10, 84)), ("fc3.bias", (10,))]

failures: list[str] = []


def check(ok: bool, what: str) -> None:
    if not ok:
        failures.append(what)
        print(f"FAIL: {what}", flush=True)


def run(cmd: list[str], log: str, expect_rc: int = 0) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    with open(log, "w") as f:
        f.write(f"$ {' '.join(cmd)}\n{out.stdout}{out.stderr}")
    if out.returncode != expect_rc:
        sys.exit(f"`{' '.join(cmd)}` exited {out.returncode} (expected {expect_rc}); log: {log}")
    return out


def train(dtrain: str, out: str, name: str, sets: list[str]) -> str:
    run_dir = os.path.join(out, name)
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [dtrain, "run", CONFIG, "--run-dir", run_dir, "--no-fetch"]
    for s in SHORT + sets:
        cmd += ["--set", s]
    run(cmd, os.path.join(out, name + ".log"))
    return run_dir


def jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def f32(x: float) -> float:
    return float(np.float32(x))


def check_tensorboard(run_dir: str, steps: int, sessions: int) -> None:
    events = glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))
    check(len(events) == sessions, f"{sessions} event file(s) in {run_dir}, found {len(events)}")
    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    metrics = jsonl(os.path.join(run_dir, "metrics.jsonl"))
    evals = jsonl(os.path.join(run_dir, "eval.jsonl"))
    check(len(metrics) == steps, f"metrics.jsonl has {len(metrics)} lines, expected {steps}")
    expected = {"train/loss": lambda r: r["loss"], "train/accuracy": lambda r: r["accuracy"],
                "train/lr": lambda r: r["lr"], "train/bytes_sent": lambda r: r["bytes_sent"],
                "train/payload_bytes": lambda r: r["payload_bytes"]}
    if metrics[0].get("ratio_name"):
        expected[f"train/{metrics[0]['ratio_name']}"] = lambda r: r["ratio"]
    # A phase absent from a record is not written for its step (`in_flight_s` is left out
    # where it is zero), so the phases are gathered over every record.
    for phase in sorted({p for r in metrics for p in r["time"]}):
        expected[f"time/{phase}"] = lambda r, p=phase: r["time"].get(p)
    expected_eval = {"eval/loss": lambda e: e["loss"], "eval/accuracy": lambda e: e["accuracy"]}
    check(tags == set(expected) | set(expected_eval),
          f"scalar tags {sorted(tags)} != {sorted(set(expected) | set(expected_eval))}")
    for series, records in ((expected, metrics), (expected_eval, evals)):
        for tag, value in series.items():
            if tag not in tags:
                continue
            points = acc.Scalars(tag)
            got = [(p.step, p.value) for p in points]
            want = [(r["step"], f32(value(r))) for r in records if value(r) is not None]
            first = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w),
                         min(len(got), len(want)))
            check(got == want, f"{tag}: {len(got)} points, {len(want)} records; the first "
                               f"difference at #{first}: {got[first:first + 1]} != {want[first:first + 1]}")
    if failures:
        return
    print(f"tensorboard ({sessions} session(s)): {len(tags)} scalar series, {len(metrics)} "
          f"steps and {len(evals)} evaluations, every point equal to metrics.jsonl / eval.jsonl")
    check("config" in acc.Tags()["tensors"], "the configuration text (tag `config`) is missing")
    if "config" in acc.Tags()["tensors"]:
        # The latest session's (each session writes its own, at its first step).
        text = acc.Tensors("config")[-1].tensor_proto.string_val[0].decode()
        with open(os.path.join(run_dir, "config.toml")) as f:
            config = f.read()
        check(config.strip() in text, "the `config` text is not the run's config.toml")


def checkpoint_sections(path: str) -> dict[str, bytes]:
    """framework/src/checkpoint.rs: "DTCKPT01", u32 count, (u32 name len, name, u64 len,
    bytes)*, u64 checksum; little-endian."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"DTCKPT01", path
    (n,), at, out = struct.unpack_from("<I", data, 8), 12, {}
    for _ in range(n):
        (k,) = struct.unpack_from("<I", data, at)
        name = data[at + 4:at + 4 + k].decode()
        (m,) = struct.unpack_from("<Q", data, at + 4 + k)
        start = at + 12 + k
        out[name] = data[start:start + m]
        at = start + m
    return out


def check_export(dtrain: str, out: str, run_dir: str) -> str:
    path = os.path.join(out, "lenet.safetensors")
    run([dtrain, "export", run_dir, "--out", path], os.path.join(out, "export.log"))
    tensors = load_file(path)
    check(sorted(tensors) == sorted(n for n, _ in LENET),
          f"exported names {sorted(tensors)} are not the twin's")
    latest = open(os.path.join(run_dir, "checkpoints", "LATEST")).read().strip()
    ck = checkpoint_sections(os.path.join(run_dir, "checkpoints", latest, "rank-0.ckpt"))
    flat = np.frombuffer(ck["params"], dtype="<f4")
    at = 0
    for name, shape in LENET:
        t = tensors.get(name)
        if t is None:
            continue
        check(t.shape == shape, f"{name}: shape {t.shape}, expected {shape}")
        check(t.dtype == np.float32, f"{name}: dtype {t.dtype}, expected float32")
        n = int(np.prod(shape))
        ours = flat[at:at + n]
        at += n
        # burn's Linear weight is [d_in, d_out]: PyTorch's is its transpose.
        want = ours.reshape(shape[::-1]).T if name.startswith("fc") and name.endswith("weight") \
            else ours.reshape(shape)
        check(np.array_equal(t, want), f"{name}: values differ from the checkpoint's")
    check(at == flat.size, f"the checkpoint holds {flat.size} values, the export {at}")
    if failures:
        return path
    print(f"export: {len(tensors)} tensors, names / shapes / dtypes of the twin, values equal "
          f"to the checkpoint at {latest}")
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtrain", default=os.path.join(ROOT, "target", "debug", "dtrain"))
    p.add_argument("--out", default=os.path.join(ROOT, "target", "interop"))
    args = p.parse_args()
    dtrain = os.path.abspath(args.dtrain)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)

    first = train(dtrain, out, "lenet-tb", ["output.tensorboard=true"])
    check_tensorboard(first, STEPS, 1)
    weights = check_export(dtrain, out, first)

    second = train(dtrain, out, "lenet-init", [f'model.init_from="{weights}"', "train.lr=1e-30",
                                                "train.max_steps=1"])
    loss = [json.load(open(os.path.join(d, "summary.json")))["final_eval"]["loss"]
            for d in (first, second)]
    check(loss[0] == loss[1], f"init_from: final eval loss {loss[1]!r} != the run's {loss[0]!r}")
    print(f"init_from: final evaluation loss {loss[1]!r}, the exported run's {loss[0]!r}")

    # A resumed session (10 steps more from the checkpoint at step 30) writes a second event
    # file; TensorBoard still shows one point per step.
    cmd = [dtrain, "run", CONFIG, "--resume", first, "--no-fetch"]
    for s in SHORT + ["output.tensorboard=true", f"train.max_steps={STEPS + 10}"]:
        cmd += ["--set", s]
    run(cmd, os.path.join(out, "lenet-tb-resume.log"))
    check_tensorboard(first, STEPS + 10, 2)

    # Bad input: one line, exit 1.
    cut = os.path.join(out, "cut.safetensors")
    with open(weights, "rb") as f, open(cut, "wb") as g:
        g.write(f.read()[:1000])
    bad = [
        ("truncated file", [dtrain, "run", CONFIG, "--run-dir", os.path.join(out, "bad1"),
                            "--no-fetch", "--set", f'model.init_from="{cut}"'], "cut.safetensors"),
        ("wrong architecture", [dtrain, "run", CONFIG, "--run-dir", os.path.join(out, "bad2"),
                                "--no-fetch", "--set", f'model.init_from="{weights}"',
                                "--set", 'model.kind="mlp"'], "does not fit model mlp"),
        ("unknown --step", [dtrain, "export", first, "--step", "7", "--out",
                            os.path.join(out, "x.safetensors")], "no checkpoint at step 7"),
    ]
    for what, cmd, needle in bad:
        r = run(cmd, os.path.join(out, what.replace(" ", "-") + ".log"), expect_rc=1)
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        last = lines[-1] if lines else ""
        check(needle in last, f"{what}: the error line {last!r} does not say {needle!r}")
        check(len([line for line in lines if "error" in line]) == 1,
              f"{what}: more than one error line: {lines}")
        print(f"{what}: exit 1, {last}")

    if failures:
        print(f"{len(failures)} failure(s)")
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
