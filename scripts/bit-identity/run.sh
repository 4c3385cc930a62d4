#!/usr/bin/env bash
# Bit-identity check for refactors (issue 20): the same short runs of the experiments that
# exercise every exchange path (FFT with EF, DGC, MIPD on the PS, top-k over all-gather and
# sparse all-reduce, DLCP, dense and compressed PS, ScaleCom), written under OUTDIR.
# Run it with the binary of the commit before the change and with the new one, then
#   python3 scripts/bit-identity/compare.py OUT_BEFORE OUT_AFTER
# usage: scripts/bit-identity/run.sh BIN OUTDIR   (from anywhere; data from DTRAIN_DATA_DIR
# or ./data, filled by `dtrain data fetch mnist`)
set -u
bin=$(realpath "$1"); out=$2; mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/../.."
export DTRAIN_DATA_DIR=${DTRAIN_DATA_DIR:-$PWD/data}
one() { # label, config, args...
  local label=$1 cfg=$2; shift 2
  echo "== $label"
  timeout 900 "$bin" run "$cfg" --set "output.dir=\"$out/$label\"" "$@" > "$out/$label.log" 2>&1 || echo "  $label FAILED rc=$?"
}
one alexnet_fft experiments/alexnet_fft.toml --set train.max_steps=120
one dgc_resnet20 experiments/dgc_resnet20.toml --variant dgc --set train.max_steps=12
one mipd_ps experiments/mipd_ps.toml --variant mipd --variant mipd-gradient-ef --set train.max_steps=60
one sparse_allreduce experiments/sparse_allreduce.toml --variant ag-1pct-p2 --variant sa-1pct-p2 --set train.max_steps=30
one dlcp_tail experiments/dlcp_tail.toml --variant ring --variant reliable --set train.max_steps=12
one ps_lenet experiments/lenet_mnist.toml --set cluster.workers=2 --set 'cluster.mode="ps"' --set cluster.staleness=1 --set train.max_steps=60
one scalecom experiments/scalecom_workers.toml --variant scalecom-p2 --set train.max_steps=20
one ps_topk experiments/lenet_mnist.toml --set cluster.workers=2 --set 'cluster.mode="ps"' --set cluster.staleness=0 --set 'compress={ kind = "topk", ratio = 0.05 }' --set train.max_steps=40
one fft_noef experiments/alexnet_fft.toml --set compress.error_feedback=false --set train.max_steps=20 --set cluster.workers=3
