# experiments/vs_pytorch/common.sh — sourced by compare.sh, ddp.sh and grace.sh (from the
# repository root, after `tool=NAME`): their refusal of a loaded machine and how they find
# dtrain and a python with torch. Sets `bin` and `py`; defines `die`.

die() { echo "$tool: $*" >&2; exit 1; }

# Timings are only worth publishing from an idle machine: refuse while the 1-minute load is
# above 0.3 or a rustc is running (COMPARE_FORCE=1 skips the check).
if [ "${COMPARE_FORCE:-0}" != 1 ]; then
  load=$(cut -d' ' -f1 /proc/loadavg)
  python3 -c "import sys; sys.exit(0 if float('$load') <= 0.3 else 1)" \
    || die "1-minute load is $load (> 0.3): not an idle machine (COMPARE_FORCE=1 to run anyway)"
  if pgrep -x rustc >/dev/null; then
    die "a rustc is running: not an idle machine (COMPARE_FORCE=1 to run anyway)"
  fi
fi

# DTRAIN_BIN (default target/release/dtrain, built if missing); PYTHON (default
# venv/bin/python when there is one, else python3), which must import torch.
bin=${DTRAIN_BIN:-target/release/dtrain}
[ -x "$bin" ] || cargo build --release -p dtrain-cli
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x venv/bin/python ]; then py=venv/bin/python; else py=python3; fi
fi
"$py" -c "import torch" 2>/dev/null || die "$py has no torch (see experiments/vs_pytorch/README.md)"
