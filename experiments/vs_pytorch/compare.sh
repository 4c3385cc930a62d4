#!/usr/bin/env bash
# experiments/vs_pytorch/compare.sh — dtrain's CPU step time beside PyTorch's, same models,
# same batch, same thread counts, interleaved over several rounds (issue #26).
#
#   experiments/vs_pytorch/compare.sh [ROUNDS] [OUT]     (default 3 rounds, OUT = runs/vs-pytorch)
#
# Environment: DTRAIN_BIN (default target/release/dtrain, built if missing), PYTHON (a python
# with torch; default venv/bin/python, else python3), MODELS (default
# "mlp/mnist,lenet/lenet5,alexnet/cifar,resnet/resnet20,lstm/word"; `:key=value;…` options
# the twin mirrors, e.g. the issue's MLP "mlp/mnist:image_size=32;hidden=[2048,1024]"),
# THREADS (default "1 2"), STEPS (default 10), WARMUP (default 2), BATCH (default: each
# tool's own, 32 images or 20 sequences).
#
# Every round runs, for each thread count, `dtrain bench models --json` and the PyTorch twins
# (`models.py --json`) one after the other, so slow drift of the machine touches both alike.
# The table takes each figure's median over the rounds and the ratio dtrain / PyTorch; the
# last column is each framework's speed-up from the first thread count to the last. Like every
# timing here, it is only worth publishing from an idle machine: the script refuses to start
# while the 1-minute load is above 0.3 or a rustc is running (COMPARE_FORCE=1 skips the check).
set -euo pipefail
cd "$(dirname "$0")/../.."

rounds=${1:-3}
out=${2:-runs/vs-pytorch}
models=${MODELS:-mlp/mnist,lenet/lenet5,alexnet/cifar,resnet/resnet20,lstm/word}
threads=${THREADS:-1 2}
steps=${STEPS:-10}
warmup=${WARMUP:-2}
batch=()
[ -n "${BATCH:-}" ] && batch=(--batch "$BATCH")

tool=compare
# shellcheck source=experiments/vs_pytorch/common.sh
. experiments/vs_pytorch/common.sh

mkdir -p "$out"
for r in $(seq 1 "$rounds"); do
  for t in $threads; do
    echo "compare: round $r/$rounds, $t thread(s): dtrain"
    RAYON_NUM_THREADS=$t "$bin" bench models --models "$models" --warmup "$warmup" \
      --steps "$steps" "${batch[@]}" --json >"$out/dtrain-t$t-r$r.json"
    echo "compare: round $r/$rounds, $t thread(s): pytorch"
    "$py" experiments/vs_pytorch/models.py --threads "$t" --models "$models" \
      --warmup "$warmup" --steps "$steps" "${batch[@]}" --json >"$out/pytorch-t$t-r$r.json"
  done
done

"$py" - "$out" "$rounds" "$threads" <<'EOF' | tee "$out/compare.md"
import json, statistics, sys
out, rounds, threads = sys.argv[1], int(sys.argv[2]), sys.argv[3].split()
def rows(fw, t, r):
    # dtrain prints a model's `;` option separators as `,`: one spelling for both.
    return {row["model"].replace(";", ","): row for row in json.load(open(f"{out}/{fw}-t{t}-r{r}.json"))}
def load(fw, t, r):
    return {m: row["timing"] for m, row in rows(fw, t, r).items()}
runs = {(fw, t): [load(fw, t, r) for r in range(1, rounds + 1)]
        for fw in ("dtrain", "pytorch") for t in threads}
# A twin with another parameter count is another model: its ratio would mean nothing.
params = {fw: {m: row["params"] for m, row in rows(fw, threads[0], 1).items()}
          for fw in ("dtrain", "pytorch")}
for m, n in params["dtrain"].items():
    if params["pytorch"].get(m) != n:
        sys.exit(f"compare: {m}: dtrain's model has {n} parameters, the twin {params['pytorch'].get(m)}")
def med(fw, t, model, key):
    return statistics.median(run[model][key] for run in runs[(fw, t)])
models = list(runs[("dtrain", threads[0])][0])
print(f"\nmedian of {rounds} rounds, ms per step (forward / backward); ratio = dtrain / PyTorch\n")
head = "| model | threads | dtrain step | dtrain fwd / bwd | PyTorch step | PyTorch fwd / bwd | ratio |"
print(head)
print("|---|---|---|---|---|---|---|")
for m in models:
    for t in threads:
        d, p = med("dtrain", t, m, "step_ms"), med("pytorch", t, m, "step_ms")
        print(f"| {m} | {t} | {d:.1f} | {med('dtrain', t, m, 'forward_ms'):.1f} / "
              f"{med('dtrain', t, m, 'backward_ms'):.1f} | {p:.1f} | "
              f"{med('pytorch', t, m, 'forward_ms'):.1f} / {med('pytorch', t, m, 'backward_ms'):.1f}"
              f" | {d / p:.2f}x |")
if len(threads) > 1:
    a, b = threads[0], threads[-1]
    print(f"\nspeed-up from {a} to {b} threads (step time)\n")
    print("| model | dtrain | PyTorch |")
    print("|---|---|---|")
    for m in models:
        print(f"| {m} | {med('dtrain', a, m, 'step_ms') / med('dtrain', b, m, 'step_ms'):.2f}x | "
              f"{med('pytorch', a, m, 'step_ms') / med('pytorch', b, m, 'step_ms'):.2f}x |")
EOF
