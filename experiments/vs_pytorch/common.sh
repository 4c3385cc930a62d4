# experiments/vs_pytorch/common.sh — sourced by compare.sh, ddp.sh and grace.sh (from the
# repository root, after `tool=NAME`): their refusal of a loaded machine and how they find
# dtrain and a python with torch. Sets `bin` and `py`; defines `die`.

die() { echo "$tool: $*" >&2; exit 1; }

# shellcheck source=scripts/lib/idle.sh
. scripts/lib/idle.sh
require_idle COMPARE_FORCE

# DTRAIN_BIN (default target/release/dtrain, built if missing); PYTHON (default
# venv/bin/python when there is one, else python3), which must import torch.
bin=${DTRAIN_BIN:-target/release/dtrain}
[ -x "$bin" ] || cargo build --release -p dtrain-cli
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x venv/bin/python ]; then py=venv/bin/python; else py=python3; fi
fi
"$py" -c "import torch" 2>/dev/null || die "$py has no torch (see experiments/vs_pytorch/README.md)"
