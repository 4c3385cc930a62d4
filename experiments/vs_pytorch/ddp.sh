#!/usr/bin/env bash
# experiments/vs_pytorch/ddp.sh — dtrain's training step beside PyTorch DDP's (gloo): the
# same model, batch per worker, worker count, optimizer and synthetic data, one process per
# worker with one thread each, interleaved over several rounds (issue #25, scope 3).
#
#   experiments/vs_pytorch/ddp.sh [ROUNDS] [OUT]     (default 3 rounds, OUT = runs/vs-pytorch-ddp)
#
# Environment: DTRAIN_BIN (default target/release/dtrain, built if missing), PYTHON (a python
# with torch; default venv/bin/python, else python3), MODELS (default "mlp"; "mlp resnet20"
# adds ResNet-20), TRANSPORTS (dtrain's, default "shm tcp"; PyTorch's gloo is TCP).
#
# The models: "mlp" is issue 25's 1024-2048-1024-10 MLP (4.2 M parameters), batch 64 per
# worker, SGD lr 0.002 momentum 0.9, 100 timed steps (`experiments/mlp_compress_step.toml`,
# variant none); "resnet20" is ResNet-20 on 3×32×32 images, batch 32 per worker, SGD lr 0.1
# momentum 0.9 weight decay 1e-4, 30 timed steps (`experiments/resnet20_overhead.toml` on
# synthetic data). Both run 2 workers. Each run's figure is the median over its steps after
# the first 10 (5 for ResNet-20), taken from rank 0's `metrics.jsonl` for dtrain and from
# rank 0's own timings for PyTorch (`ddp.py`); the table takes each figure's median over the
# rounds, and the ratio dtrain ÷ PyTorch of the step. Like every timing here it is only worth
# publishing from an idle machine: the script refuses to start while the 1-minute load is
# above 0.3 or a rustc is running (COMPARE_FORCE=1 skips the check).
set -euo pipefail
set -f  # the model options hold brackets: no globbing
cd "$(dirname "$0")/../.."

rounds=${1:-3}
out=${2:-runs/vs-pytorch-ddp}
models=${MODELS:-mlp}
transports=${TRANSPORTS:-shm tcp}

tool=ddp
# shellcheck source=experiments/vs_pytorch/common.sh
. experiments/vs_pytorch/common.sh

# dtrain's run and PyTorch's arguments for each model (the same model, batch, optimizer).
dtrain_args() {
  case $1 in
    mlp) echo "experiments/mlp_compress_step.toml --variant none" ;;
    resnet20) echo "experiments/resnet20_overhead.toml --set data.kind=\"synthetic\"
      --set data.shape=[3,32,32] --set data.train_len=2240 --set data.test_len=64" ;;
    *) die "unknown model $1 (mlp, resnet20)" ;;
  esac
}
torch_args() {
  case $1 in
    mlp) echo "--model mlp/mnist:image_size=32;hidden=[2048,1024] --batch 64 --steps 90
      --warmup 10 --lr 0.002 --momentum 0.9" ;;
    resnet20) echo "--model resnet/resnet20 --batch 32 --steps 30 --warmup 5 --lr 0.1
      --momentum 0.9 --weight-decay 1e-4" ;;
  esac
}
skip() { case $1 in mlp) echo 10 ;; resnet20) echo 5 ;; esac; }

mkdir -p "$out"
for r in $(seq 1 "$rounds"); do
  for m in $models; do
    for t in $transports; do
      echo "ddp: round $r/$rounds, $m: dtrain over $t"
      dir="$out/dtrain-$m-$t-r$r"
      rm -rf "$dir"
      # shellcheck disable=SC2046  # the arguments are words
      "$bin" run $(dtrain_args "$m") --set "cluster.transport=\"$t\"" \
        --set "output.dir=\"$dir\"" >"$dir.log" 2>&1 || die "dtrain failed: see $dir.log"
    done
    echo "ddp: round $r/$rounds, $m: pytorch DDP"
    # shellcheck disable=SC2046
    "$py" experiments/vs_pytorch/ddp.py $(torch_args "$m") --threads 1 --world 2 --json \
      >"$out/pytorch-$m-r$r.json" 2>"$out/pytorch-$m-r$r.log" \
      || die "ddp.py failed: see $out/pytorch-$m-r$r.log"
  done
done

skips=""
for m in $models; do skips="$skips $m=$(skip "$m")"; done
"$py" - "$out" "$rounds" "$models" "$transports" "$skips" <<'EOF' | tee "$out/ddp.md"
import glob, json, statistics, subprocess, sys
out, rounds, models, transports = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), sys.argv[4].split()
skip = dict(kv.split("=") for kv in sys.argv[5].split())
med = statistics.median

def dtrain_run(m, t, r):
    (path,) = glob.glob(f"{out}/dtrain-{m}-{t}-r{r}/**/metrics.jsonl", recursive=True)
    rows = [json.loads(line) for line in open(path)][int(skip[m]):]
    times = [row["time"] for row in rows]
    ex = lambda x: x["compress_s"] + x["communicate_s"] + x["decompress_s"]
    return {
        "step_ms": med(x["step_s"] for x in times) * 1e3,
        "forward_ms": med(x["forward_s"] for x in times) * 1e3,
        "backward_ms": med(x["backward_s"] for x in times) * 1e3,
        "exchange_ms": med(ex(x) for x in times) * 1e3,
        "optimizer_ms": med(x["optimizer_s"] for x in times) * 1e3,
        "data_ms": med(x["data_s"] for x in times) * 1e3,
    }

def torch_run(m, r):
    return json.load(open(f"{out}/pytorch-{m}-r{r}.json"))

commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                        text=True).stdout.strip() or "?"
first = torch_run(models[0], 1)
print(f"\ndtrain {commit} vs {first['framework']}, {rounds} interleaved rounds, 2 workers × 1 thread;")
print("median over rounds of each run's median step, ms. dtrain's exchange = compress + "
      "communicate (with the control all-reduce) + decompress; PyTorch's all-reduce runs "
      "inside its backward.\n")
print("| model | run | step | data | forward | backward | exchange | optimizer | ÷ PyTorch |")
print("|---|---|---|---|---|---|---|---|---|")
for m in models:
    tr = [torch_run(m, r)["timing"] for r in range(1, rounds + 1)]
    p = {k: med(x[k] for x in tr) for k in tr[0]}
    for t in transports:
        dr = [dtrain_run(m, t, r) for r in range(1, rounds + 1)]
        d = {k: med(x[k] for x in dr) for k in dr[0]}
        per = " / ".join(f"{x['step_ms'] / y['step_ms']:.2f}" for x, y in zip(dr, tr))
        print(f"| {m} | dtrain {t} | {d['step_ms']:.1f} | {d['data_ms']:.1f} | {d['forward_ms']:.1f} | "
              f"{d['backward_ms']:.1f} | {d['exchange_ms']:.1f} | {d['optimizer_ms']:.1f} | "
              f"**{d['step_ms'] / p['step_ms']:.2f}×** ({per}) |")
    print(f"| {m} | PyTorch DDP gloo | {p['step_ms']:.1f} | {p['data_ms']:.1f} | {p['forward_ms']:.1f} | "
          f"{p['backward_ms']:.1f} (incl. all-reduce) | {p['comm_ms']:.1f} apart | "
          f"{p['optimizer_ms']:.1f} | 1 |")
EOF
