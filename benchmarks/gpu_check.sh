#!/usr/bin/env bash
# Issue 21 on one GPU, in one call of under 8 minutes: the tests marked `gpu`, the CUDA tests of
# tests/test_attention.py, then benchmarks/gpu_step.py (the 0.9B llama step: nf.jit, compiled and
# not, against eager and torch.compile, tokens/s and MFU).
#
#     bash benchmarks/gpu_check.sh              # from anywhere; logs and JSON under $OUT if set, else /tmp/gpu_check
#     PYTHON=/path/to/python bash benchmarks/gpu_check.sh
#
# It installs nothing from a network. The interpreter: $PYTHON, else the first of .venv/bin/python
# and python3 whose torch sees a GPU (a .venv made on a CPU machine holds a CPU torch: then
# python3, the GPU image's own). The repository is put on PYTHONPATH, so ndfunc needs no install;
# its other dependencies (optree, einops, rich, safetensors) must be importable. Where one is
# missing and wheels were carried in .whl/ (see the device notes), they are installed from there,
# offline, into /tmp/site; else `pip install -e '.[dev]'` would be the way on a machine with a
# network (it keeps the machine's own torch, which satisfies `torch>=2.13`).
# Exit status: 0 when every step passed, else the first failing step's.
set -euo pipefail

cd "$(dirname "$0")/.."
LOGS="${OUT:-/tmp/gpu_check}"
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi 2>&1 | tee "$LOGS/nvidia-smi.txt" || true
fi

has_torch() {  # has_torch PYTHON [cuda]: its torch imports (and sees a GPU)
    command -v "$1" >/dev/null 2>&1 &&
        "$1" -c "import sys, torch; sys.exit(0 if '$2' != 'cuda' or torch.cuda.is_available() else 1)" >/dev/null 2>&1
}
PY="${PYTHON:-}"
for need in cuda any; do
    for candidate in .venv/bin/python python3; do
        if [ -z "$PY" ] && has_torch "$candidate" "$need"; then PY="$candidate"; fi
    done
done
PY="${PY:-python3}"
BENCH_ARGS=()
if ! has_torch "$PY" cuda; then  # a CPU machine: the gpu tests skip, the benchmark is the tiny check
    echo "gpu_check: $PY's torch sees no GPU: the gpu tests will be skipped, the benchmark runs --device cpu --tiny" >&2
    BENCH_ARGS=(--device cpu --tiny)
fi

if ! "$PY" -c 'import optree, einops, rich, safetensors' 2>/dev/null && [ -d .whl ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
"$PY" - <<'EOF' 2>&1 | tee "$LOGS/versions.txt"
import sys, torch
print(f"python {sys.version.split()[0]} at {sys.executable}; torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"GPU: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
if (major, minor) < (2, 13):
    # On 2.11's CPU build this file's tests and the llama's pass; 15 of the not-slow suite do not:
    # 2.11's DTensor has no rules for index, constant_pad_nd, squeeze.dims and convolution, and
    # LocalTensor no rank_map
    print(f"warning: ndfunc asks for torch>=2.13 (its private-API uses are pinned to it); this is {torch.__version__}")
try:  # fail here, not in the middle of the tests, when a dependency is missing
    import ndfunc  # noqa: F401
except ImportError as e:
    sys.exit(f"gpu_check: ndfunc does not import ({e}): carry the missing packages as wheels in .whl/ "
             f"(python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .whl NAME)")
EOF

status=0
step() {  # step NAME SECONDS COMMAND...: run it under a time limit, its output to the log too
    local name="$1" limit="$2"
    shift 2
    echo "== $name (at most ${limit}s): $*"
    local rc=0
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$LOGS/$name.txt" || rc=$?
    echo "== $name: exit $rc"
    if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
}

# every test marked `gpu` is in tests/test_gpu.py (the rest of that file, lowered for CUDA, runs too);
# -rA lists each test's outcome; -n 0: one process on the one GPU; a GPU image may carry
# pytest-benchmark, which warns under xdist (an error under our filterwarnings): it is left out
PYTEST=("$PY" -m pytest -q -rA -n 0 -p no:cacheprovider -p no:benchmark)
step gpu_tests 150 "${PYTEST[@]}" tests/test_gpu.py
step attention_tests 40 "${PYTEST[@]}" tests/test_attention.py -k on_a_gpu
if [ -z "${SKIP_BENCHMARK:-}" ]; then  # SKIP_BENCHMARK=1: the tests alone
    # GPU_STEP_ARGS: more of gpu_step.py's arguments (--only jit eager --profile 2)
    # on an H200: about 3 minutes, two of them the first compiled steps (torch.compile 42 s, nf.jit compiled 89 s)
    step gpu_step 300 "$PY" benchmarks/gpu_step.py "${BENCH_ARGS[@]}" ${GPU_STEP_ARGS:-} --json "$LOGS/gpu_step.json"
fi

echo "gpu_check: logs in $LOGS; exit $status"
exit "$status"
