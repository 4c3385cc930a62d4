#!/usr/bin/env bash
# experiments/vs_pytorch/grace.sh — dtrain's compressors beside GRACE's (PyTorch), on the
# same vector, one thread each, interleaved over several rounds (issue #25, the compressors'
# goal: each method at least 10× GRACE's compression throughput, or at least 60 % of the
# one-core single-pass read bandwidth that `dtrain bench compress` prints in the same run).
#
#   GRACE_DIR=path/to/grace experiments/vs_pytorch/grace.sh [ROUNDS] [OUT]
#       (default 3 rounds, OUT = runs/vs-grace)
#
# Environment: GRACE_DIR (a checkout of github.com/sands-lab/grace; required), DTRAIN_BIN,
# PYTHON (a python with torch, as for compare.sh), ELEMS (default 4194304: 16 MB of f32).
# The input is N(0, 0.01²) values drawn once by torch (seed 1) into OUT/input.f32, read by
# `dtrain bench compress --from` and by `grace.py --from`, so the threshold keeps the same
# elements in both. The table takes each figure's median over the rounds.
set -euo pipefail
cd "$(dirname "$0")/../.."

rounds=${1:-3}
out=${2:-runs/vs-grace}
elems=${ELEMS:-4194304}
methods="topk:ratio=0.01,dgc:ratio=0.001,threshold:tau=0.02,terngrad,onebit"

tool=grace
# shellcheck source=experiments/vs_pytorch/common.sh
. experiments/vs_pytorch/common.sh
[ -n "${GRACE_DIR:-}" ] || die "set GRACE_DIR to a checkout of github.com/sands-lab/grace"

mkdir -p "$out"
"$py" -c "
import sys, torch
g = torch.Generator().manual_seed(1)
x = (torch.randn($elems, generator=g) * 0.01).numpy().astype('<f4')
x.tofile(sys.argv[1])" "$out/input.f32"

for r in $(seq 1 "$rounds"); do
  echo "grace: round $r/$rounds: dtrain"
  "$bin" bench compress --from "$out/input.f32" --methods "$methods" --json >"$out/dtrain-r$r.json"
  echo "grace: round $r/$rounds: GRACE"
  "$py" experiments/vs_pytorch/grace.py --grace "$GRACE_DIR" --from "$out/input.f32" \
    --methods "$methods" --json >"$out/grace-r$r.json" 2>"$out/grace-r$r.log" \
    || die "grace.py failed: see $out/grace-r$r.log"
done

"$py" - "$out" "$rounds" <<'EOF' | tee "$out/grace.md"
import json, statistics, subprocess, sys
out, rounds = sys.argv[1], int(sys.argv[2])
med = statistics.median
def rows(name, r):
    return {x["method"]: x for x in json.load(open(f"{out}/{name}-r{r}.json"))["results"]}
d = [rows("dtrain", r) for r in range(1, rounds + 1)]
g = [rows("grace", r) for r in range(1, rounds + 1)]
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                        text=True).stdout.strip() or "?"
read = med(x["read_gbps"] for run in d for x in run.values())
n = next(iter(d[0].values()))["elements"]
print(f"\ndtrain {commit} vs GRACE, {n} f32 values, 1 thread, median of {rounds} interleaved "
      f"rounds; one-pass read {read:.2f} GB/s\n")
print("| method | bits/elem | dtrain comp GB/s | GRACE comp GB/s | × GRACE | comp / read | goal (≥ 10× or ≥ 60 %) | dtrain decomp GB/s | GRACE decomp GB/s |")
print("|---|---|---|---|---|---|---|---|---|")
for m in d[0]:
    dc, gc = med(x[m]["compress_gbps"] for x in d), med(x[m]["compress_gbps"] for x in g)
    of_read = med(x[m]["compress_of_read"] for x in d)
    met = "met" if dc / gc >= 10 or of_read >= 0.6 else "not met"
    print(f"| {m} | {d[0][m]['bits_per_element']:.3f} | {dc:.3f} | {gc:.3f} | {dc / gc:.1f}× | "
          f"{of_read * 100:.0f} % | {met} | {med(x[m]['decompress_gbps'] for x in d):.2f} | "
          f"{med(x[m]['decompress_gbps'] for x in g):.2f} |")
EOF
