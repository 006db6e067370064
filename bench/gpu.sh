#!/usr/bin/env bash
# GPU benchmark for one CUDA machine without network (written for the H200 of the device tool; under 8 minutes).
# Installs the wheels that `make bench-wheels` put in bench/wheels (FLA, and the transformers this package
# needs, newer than the machine's), then runs bench/gpu_bench.py; results go to $OUT (or bench/out).
#
#   make bench-wheels                      # here, with network
#   bash bench/gpu.sh [gpu_bench.py args]  # there; through the device tool: carry ["bench/wheels"], timeout_s 540
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
SITE=${SITE:-/tmp/path-hf-site}
OUT_DIR=${OUT:-bench/out}
mkdir -p "$OUT_DIR"

shopt -s nullglob
wheels=(bench/wheels/*.whl)
if ((${#wheels[@]})); then
    # --no-deps: the machine has torch, triton, einops and the rest; these override its older copies.
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "bench/wheels has no wheels (run 'make bench-wheels' where there is network): using what is installed" >&2
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
"$PYTHON" -c 'import torch, triton, transformers, fla; print("torch", torch.__version__, "triton", triton.__version__,
"transformers", transformers.__version__, "fla", fla.__version__, "cuda", torch.cuda.is_available())'

PYTHONUNBUFFERED=1 timeout 450 "$PYTHON" bench/gpu_bench.py "$@" 2>&1 | tee "$OUT_DIR/gpu_bench.log"
