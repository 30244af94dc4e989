#!/usr/bin/env bash
# The CUDA path checked in one run on a GPU machine: the tests that take a device, on CUDA, then
# benchmarks/bench_gpu.py; logs, the JSON report and its markdown table land in OUT.
#
#   scripts/gpu_check.sh                                   # on a machine with a GPU and PyTorch
#   OUT=gpu-out BENCH_ARGS="--parts train" scripts/gpu_check.sh
#
# Python packages the tests need that the machine lacks can come as wheels in .whl/ (for a machine without a package
# index); they are installed into a folder of their own, ahead of the machine's on the path. Settings, from the
# environment: PYTHON (python3), OUT (gpu-out), DEVICE (cuda; cpu tries the script itself), TEST_SECONDS (240),
# BENCH_SECONDS (360), MAXFAIL (1: stop at the first failure, as `pytest -x`), BENCH_ARGS (more bench_gpu.py flags).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-gpu-out}
TEST_SECONDS=${TEST_SECONDS:-240}
BENCH_SECONDS=${BENCH_SECONDS:-360}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/gptkit-wheels .whl/*.whl \
        || { echo "gpu_check: could not install the wheels in .whl/" >&2; exit 1; }
    export PYTHONPATH=/tmp/gptkit-wheels${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
{
    nvidia-smi
    "$PYTHON" -c 'import platform, torch, transformers; print("python", platform.python_version(), "torch",
torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)'
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

per_test=()
"$PYTHON" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 180)
timeout "$TEST_SECONDS" "$PYTHON" -m pytest tests -m "device and not slow" --device "$DEVICE" \
    --maxfail "${MAXFAIL:-1}" -q -rfE --durations 15 -p no:cacheprovider "${per_test[@]}" 2>&1 | tee "$OUT/tests.log"
tests=${PIPESTATUS[0]}

# shellcheck disable=SC2086 # BENCH_ARGS is a list of flags
timeout "$BENCH_SECONDS" "$PYTHON" benchmarks/bench_gpu.py --device "$DEVICE" --out "$OUT" \
    --budget-s $((BENCH_SECONDS - 45)) ${BENCH_ARGS:-} 2>"$OUT/bench.log"
bench=$?
echo "gpu_check: tests exit $tests, bench_gpu exit $bench (logs in $OUT)"
[ "$tests" = 0 ] && [ "$bench" = 0 ]
