#!/usr/bin/env bash
# GPU benchmark for one CUDA machine without network, sized for under 8 minutes of work on one H200
# (lab/gpu/README.md). lab/gpu/gpu_bench.py measures FLA's PaTH kernels against ours and RoPE + SDPA (parity, time,
# memory, train and decode tokens/s), and converts, recovers and evaluates SmolLM2-135M-Instruct from its GGUF
# (lab/gpu/gpu_smollm2.py: the CPU recipe's design, RoPE interleaved with PaTH and the forget gate, align and distill
# at 512- and 2048-token blocks, plus a last distill stage at 8192, the budgets scaled to the time left; evaluated to
# 32768 tokens, with YaRN on the source and on the recovered model). Results in $OUT (or runs/gpu): gpu.log,
# gpu_bench.json, gpu_bench.md, smollm2_logs.txt and three plots.
#
# The bundle reaches the machine in calls: each runs one command there in a copy of the working tree, with a few
# extra folders sent along (the carry), and sends at most lab/gpu/gpu_carry.py's CALL_LIMIT (64 MiB as set: change
# it to what your transfer allows), working tree included. The GGUF is 98 MB, so it travels in parts, one per call,
# each stored in $GPU_STORE (/tmp/path-hf-gpu) on the machine until all have arrived: every call must reach the same
# machine. The call that completes the model joins the parts, checks the sha256, installs the wheels
# (lab/gpu/wheels, `pip --no-deps --target`) and runs everything.
#
#   make bench-gpu-prepare    # here, with network: wheels, the GGUF cut into lab/gpu/carry/<call>/; prints the calls
#
# then, one call after the other (sizes as measured with a 22.0 MB working tree and the 64 MiB limit;
# `make bench-gpu-prepare` prints them for the tree as it is):
#
#   1. command "bash lab/gpu/run.sh 1"  carry ["lab/gpu/carry/1"]                    timeout_s 60   payload 58.0 MiB
#   2. command "bash lab/gpu/run.sh 2"  carry ["lab/gpu/carry/2"]                    timeout_s 60   payload 58.0 MiB
#   3. command "bash lab/gpu/run.sh 3"  carry ["lab/gpu/carry/3", "lab/gpu/wheels"]  timeout_s 560  payload 58.0 MiB
#
# Calls 1 and 2 take seconds (they also print which of the wheels' requirements the machine does not meet); call 3
# works for about 8 minutes. `bash lab/gpu/run.sh run [gpu_bench.py args]` runs again on a machine that still has the
# model (carry ["lab/gpu/wheels"]). `--dry-run-cpu` does all of it on a CPU (make bench-gpu-dry-run).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

PYTHON=${PYTHON:-python3}
STORE=${GPU_STORE:-/tmp/path-hf-gpu}
SITE=$STORE/site
OUT_DIR=${OUT:-runs/gpu}
BUDGET_S=${GPU_BUDGET_S:-450}  # gpu_bench.py --budget-s: all of its work
dry_run=""
for arg in "$@"; do
    [[ $arg == --dry-run-cpu ]] && dry_run=1
done

stage=${1:-}
case $stage in
    [1-9])
        shift
        export GPU_STORE=$STORE
        "$PYTHON" lab/gpu/gpu_carry.py receive "$stage" || { rc=$?; ((rc == 3)) && exit 0; exit "$rc"; } ;;
    run) shift ;;
    *)
        echo "usage: bash lab/gpu/run.sh N|run [--dry-run-cpu] [gpu_bench.py args] (N: the part this call carries)" >&2
        exit 2 ;;
esac

run() {
    shopt -s nullglob
    local wheels=(lab/gpu/wheels/*.whl)
    if [[ -n $dry_run ]]; then
        # The wheels are for the GPU machine's Python 3.12: the dry run uses this environment's own packages.
        echo "dry run on the CPU: the wheels are not installed"
        export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    elif ((${#wheels[@]})); then
        # --no-deps: the machine has torch, triton, einops, pyarrow and the rest; these add or override.
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            "${wheels[@]}"
        export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    else
        echo "lab/gpu/wheels has no wheels (make bench-wheels where there is network): using what is installed" >&2
        export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    fi
    "$PYTHON" lab/gpu/gpu_carry.py requirements || true

    if [[ -z $dry_run ]]; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    fi
    local gguf
    gguf=$(GPU_STORE=$STORE "$PYTHON" lab/gpu/gpu_carry.py model-path) || gguf=""
    PYTHONUNBUFFERED=1 timeout -k 30 $((${BUDGET_S%.*} + 20)) "$PYTHON" -m lab.gpu.gpu_bench --budget-s "$BUDGET_S" \
        --work-dir "$STORE/smollm2" ${gguf:+--gguf "$gguf"} "$@"
}

mkdir -p "$OUT_DIR"
run "$@" 2>&1 | tee "$OUT_DIR/gpu.log"
