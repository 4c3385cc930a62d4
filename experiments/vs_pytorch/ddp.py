#!/usr/bin/env python3
"""PyTorch DDP (gloo) training steps of a dtrain model's twin, for the step-time comparison
of `ddp.sh`: the same model, batch per worker, worker count and optimizer as a dtrain run,
one process per worker on this host, each with its own thread count.

Each worker builds the twin (`models.py`), wraps it in `DistributedDataParallel` (its
default 25 MB buckets, gradients all-reduced by gloo while backward runs), and trains with
SGD (momentum, weight decay) on synthetic batches drawn once before the loop, so the data
phase is only the indexing a map-style dataset in memory would cost. A step is: next batch;
forward with the mean cross-entropy and the loss read back (dtrain reads it every step too);
`zero_grad`, backward (which returns once DDP's all-reduce has finished); optimizer step.
Every phase is timed with `perf_counter` on every rank; rank 0 prints the medians over the
timed steps (after `--warmup` untimed ones) of its own steps, or a JSON object (`--json`).

    python experiments/vs_pytorch/ddp.py --model "mlp/mnist:image_size=32;hidden=[2048,1024]" \
        --world 2 --batch 64 --steps 100 --warmup 10 --threads 1 --lr 0.05 --momentum 0.9

DDP's all-reduce runs inside backward (its overlap), so its time is part of `backward_ms`
and not split out; `comm_ms` is the all-reduce of the gradient alone, measured apart
afterwards (`--comm-rounds` times, median) with the same buckets' total size.
"""

import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402  (the twins, beside this file)

PHASES = ("data_ms", "forward_ms", "backward_ms", "optimizer_ms", "step_ms")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    torch.manual_seed(args.seed)  # the same initial weights on every rank, as DDP checks
    twin = models.resolve(args.model)
    model = twin.build()
    params = models.count_params(model)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                          weight_decay=args.weight_decay)
    # A pool of batches drawn once (different on every rank), cycled through.
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    _, c, h, w, classes = twin.input
    pool = [(torch.randn(args.batch, c, h, w, generator=gen),
             torch.randint(0, classes, (args.batch,), generator=gen)) for _ in range(4)]
    model.train()
    rows = []
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        x, y = pool[step % len(pool)]
        t1 = time.perf_counter()
        loss = F.cross_entropy(ddp(x), y)
        loss.item()
        t2 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        t3 = time.perf_counter()
        opt.step()
        t4 = time.perf_counter()
        if step >= args.warmup:
            rows.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0))
    # The all-reduce alone, on a buffer the size of the gradient.
    flat = torch.zeros(params)
    comm = []
    for _ in range(args.comm_rounds):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(flat)
        comm.append(time.perf_counter() - t0)
    if rank == 0:
        med = {k: statistics.median(r[i] for r in rows) * 1e3 for i, k in enumerate(PHASES)}
        med["comm_ms"] = statistics.median(comm) * 1e3
        queue.put({
            "framework": f"pytorch {torch.__version__} DDP gloo",
            "model": args.model,
            "params": params,
            "world": args.world,
            "batch": args.batch,
            "threads": args.threads,
            "steps": args.steps,
            "warmup": args.warmup,
            "timing": med,
        })
    dist.destroy_process_group()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mlp/mnist:image_size=32;hidden=[2048,1024]",
                   help="dtrain kind/variant[:options] of an image model (models.py)")
    p.add_argument("--world", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--batch", type=int, default=64, help="images per worker and step")
    p.add_argument("--steps", type=int, default=100, help="timed steps (default 100)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (default 10)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--comm-rounds", type=int, default=20,
                   help="all-reduces of the gradient's size timed apart (default 20)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    for name in ("world", "batch", "steps", "threads", "comm_rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        p.error("--warmup must not be negative")
    try:
        twin = models.resolve(args.model)
    except ValueError as e:
        p.error(str(e))
    if twin.is_language_model:
        p.error(f"--model {args.model}: image models only (the MLP, LeNet, AlexNet, VGG, ResNet)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(worker, args=(args, free_port(), queue), nprocs=args.world,
                       start_method="spawn")
    row = queue.get()
    if args.json:
        print(json.dumps(row))
    else:
        t = row["timing"]
        print(f"{row['framework']}: {row['model']}, {row['params']} parameters, "
              f"{row['world']} workers × batch {row['batch']}, {row['threads']} thread(s)")
        print("median ms: " + ", ".join(f"{k[:-3]} {t[k]:.2f}" for k in PHASES + ("comm_ms",)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
