#!/usr/bin/env bash
# The GPU check of issue 31, in one run on a machine with one GPU, torch and no network (an H100/H200 with
# Python 3.12 and torch 2.11+cu130 preinstalled, with numpy, scipy, matplotlib, tqdm, pytest, pytest-xdist,
# hypothesis, pytest-timeout, triton, scikit-learn; not mnist1d). Run from the checkout's root:
#
#     OUT=/some/dir tools/gpu_check.sh          # on the GPU machine (OUT: where the logs go; default /tmp/...)
#     DRY=1 tools/gpu_check.sh                  # here, on the CPU: the same stages at tiny sizes
#
# The wheels it needs travel in .whl/ (git-ignored). Made where there is network, in the checkout's root:
#
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#         -d .whl mnist1d==0.0.2.post1
#
# (mnist1d is pure Python; its own needs -- numpy, scipy, matplotlib, requests -- are on that machine. For another
# missing package: `unzip -p .whl/NAME-*.whl '*/METADATA' | grep ^Requires-Dist` lists what it needs; keep one
# version of each.) The script installs them with `pip install --no-index --no-deps --target` into a folder put
# first on PYTHONPATH, with the checkout itself, so the checkout's thinwire is the one imported everywhere.
#
# Stages (each under its own `timeout`, so one hang does not eat the rest; together at most TOTAL seconds,
# default 540): the environment; the CUDA cases of the test suite (`-k cuda`: the `device` fixture's cuda
# parameter) and tests/test_shared_gpu.py (workers sharing the GPU over gloo); `thinwire bench gpu`'s overhead
# and compressor parts; `thinwire bench overhead --device cuda` where that benchmark exists; `thinwire train
# --workload stdlib-lm --device cuda --workers 1`, short; `thinwire bench gpu`'s race last. Logs and JSON go to
# $OUT (8 files: the device tool brings back at most 8),
# and a summary table is printed last (also $OUT/summary.txt). Exit status: 0 when every stage passed.
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/thinwire-gpu-check}
TOTAL=${TOTAL:-540}
WORK=$(mktemp -d /tmp/thinwire-gpu-check.XXXXXX)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 THINWIRE_NO_PROGRESS=1 THINWIRE_CACHE="$WORK/cache"

if [ "${DRY:-0}" = 1 ]; then      # the CPU, tiny sizes: checks that every stage runs, measures nothing
    DEV=cpu
    TESTS=(tests/test_shared_gpu.py tests/test_bench_gpu.py)
    BENCH=(--device cpu --parts overhead,compressors)
    RACE=(--device cpu --parts race)
    OVERHEAD=(--device cpu --steps 20 --round 10)
    TRAIN=(--device cpu --steps 10)
else
    DEV=cuda
    TESTS=(tests)
    BENCH=(--parts overhead,compressors)   # compressors after the overhead: their first calls compile kernels
    RACE=(--parts race --budget 12)
    OVERHEAD=(--device cuda)
    TRAIN=(--device cuda --steps 200)
fi

# the carried wheels, then the checkout, first on the path (also of every worker process the tests start)
SITE="$WORK/site"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        .whl/*.whl || echo "warning: installing .whl/*.whl failed" >&2
fi
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"

rows=()
stage() {   # stage NAME LIMIT_S LOG -- command...: run it under `timeout`, its output in $OUT/LOG; a summary row
    local name=$1 limit=$2 log=$3
    shift 4
    local left=$((TOTAL - SECONDS - 5))
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$limit" -lt 10 ]; then
        rows+=("$(printf '%-22s %-10s %6s  %s' "$name" "skipped" "-" "no time left of TOTAL=${TOTAL}s")")
        return
    fi
    echo "== $name (at most ${limit}s): $*" | tee -a "$OUT/$log"
    local t0=$SECONDS rc
    timeout --kill-after=10 "$limit" "$@" >>"$OUT/$log" 2>&1
    rc=$?
    local status=ok
    [ $rc -ne 0 ] && status="rc=$rc"
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && status="TIMEOUT"
    rows+=("$(printf '%-22s %-10s %5ss  %s' "$name" "$status" "$((SECONDS - t0))" "$OUT/$log")")
    tail -n 25 "$OUT/$log"
}

stage "environment" 60 summary.txt -- "$PYTHON" -c "
import platform, sys, torch, thinwire
print('python', sys.version.split()[0], platform.machine(), '| torch', torch.__version__, '| thinwire', thinwire.__version__, 'from', thinwire.__file__)
print('cuda available:', torch.cuda.is_available(), '| devices:', [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
import mnist1d, sklearn, scipy, matplotlib; print('mnist1d, sklearn, scipy, matplotlib: importable')
if '$DEV' == 'cuda' and not torch.cuda.is_available(): sys.exit('no CUDA device: run with DRY=1 on a machine without a GPU')
"
if [ "$DEV" = cuda ]; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$OUT/summary.txt" 2>&1; fi

# the CUDA parametrisation (the `device` fixture's cuda cases) and the tests of workers sharing the GPU
if [ "$DEV" = cuda ]; then
    stage "tests (cuda)" 180 tests.log -- "$PYTHON" -m pytest -q -p no:cacheprovider -n 4 --dist loadfile \
        -k "cuda or shared_gpu" -m "not processes" --timeout 150 "${TESTS[@]}"
else
    stage "tests (cpu)" 200 tests.log -- "$PYTHON" -m pytest -q -p no:cacheprovider \
        --timeout 150 "${TESTS[@]}"
fi

stage "bench gpu" 260 bench_gpu.log -- "$PYTHON" -m thinwire bench gpu "${BENCH[@]}" --out "$WORK/bench_gpu"
cp "$WORK/bench_gpu/bench_gpu.json" "$OUT/" 2>/dev/null

if "$PYTHON" -m thinwire bench overhead --help >/dev/null 2>&1; then
    stage "bench overhead" 90 overhead.log -- "$PYTHON" -m thinwire bench overhead "${OVERHEAD[@]}" \
        --out "$OUT/overhead.json"
else
    rows+=("$(printf '%-22s %-10s %6s  %s' "bench overhead" "absent" "-" "thinwire bench overhead is not in this checkout")")
fi

stage "train stdlib-lm" 60 train.log -- "$PYTHON" -m thinwire train --workload stdlib-lm --workers 1 \
    "${TRAIN[@]}" --out "$WORK/train"

# the race last (it ran before; what is new is above): 4 workers sharing the GPU
stage "bench gpu race" 100 bench_gpu.log -- "$PYTHON" -m thinwire bench gpu "${RACE[@]}" --out "$WORK/race"
cp "$WORK/race/bench_gpu.json" "$OUT/bench_race.json" 2>/dev/null

{
    echo
    echo "== summary ($DEV, $SECONDS s in all; logs in $OUT)"
    printf '%s\n' "${rows[@]}"
} | tee -a "$OUT/summary.txt"
rm -rf "$WORK"
for r in "${rows[@]}"; do case "$r" in *" ok "*|*"absent"*) ;; *) exit 1 ;; esac; done
exit 0
