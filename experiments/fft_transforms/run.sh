#!/usr/bin/env bash
# The floor under the FFT codec's cost: the forward and inverse real FFTs of the main job's
# six weight tensors alone, with the library dtrain uses (realfft/rustfft) and with FFTW 3,
# interleaved over ROUNDS rounds (default 3), one thread each. Needs a C compiler and
# FFTW's single-precision library (Debian: apt-get install libfftw3-dev); without them the
# FFTW rows are skipped. Usage: experiments/fft_transforms/run.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")"
rounds=${1:-3}
target=${CARGO_TARGET_DIR:-/tmp/fft-transforms-target}
CARGO_TARGET_DIR=$target cargo build --release --quiet
fftw=""
if cc -O2 fftw.c -o "$target/fftw-transforms" -lfftw3f -lm 2>/dev/null; then
    fftw="$target/fftw-transforms"
else
    echo "(no FFTW: cc or libfftw3-dev missing; rustfft only)"
fi
for r in $(seq "$rounds"); do
    echo "round $r"
    "$target/release/fft-transforms" | grep total
    if [ -n "$fftw" ]; then "$fftw" | grep total; fi
done
