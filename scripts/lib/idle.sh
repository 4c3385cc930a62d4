# scripts/lib/idle.sh — sourced by the timing scripts (scripts/auto-timing,
# scripts/quic-vs-tcp, experiments/vs_pytorch/common.sh) after they define `die`.
#
#   require_idle FORCE_VARIABLE_NAME
#
# Timings are only worth publishing from an idle machine: fails (through `die`) while the
# 1-minute load is above 0.3 or a rustc is running, unless the named variable is 1.
require_idle() {
  local force=$1
  [ "${!force:-0}" = 1 ] && return 0
  local load
  load=$(cut -d' ' -f1 /proc/loadavg)
  python3 -c "import sys; sys.exit(0 if float('$load') <= 0.3 else 1)" \
    || die "1-minute load is $load (> 0.3): not an idle machine ($force=1 to run anyway)"
  if pgrep -x rustc >/dev/null; then
    die "a rustc is running: not an idle machine ($force=1 to run anyway)"
  fi
}
