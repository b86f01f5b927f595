#!/usr/bin/env bash
# GPU end-to-end benchmark: original vs folded vs folded+fused GPT-2 / OPT-125M-class /
# BERT-base-class in fp16, batch 1 and 8, sequence 128 to 4096, eager, CUDA graphs and
# torch.compile (< 5 minutes on one GPU: a time budget inside skips and lists what does not fit).
# Installs nothing: runs the source tree (PYTHONPATH=src) with the first Python that has torch
# (with CUDA, unless --dry-run) and transformers.
#   bash benchmarks/gpu_e2e.sh             # tables into $OUT if set, else benchmarks/results/
#   bash benchmarks/gpu_e2e.sh --dry-run   # the same code path on the CPU with tiny configs
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

need_cuda=1
for arg in "$@"; do [ "$arg" = "--dry-run" ] && need_cuda=0; done
probe="import torch, transformers; assert $need_cuda == 0 or torch.cuda.is_available()"

py=""
for candidate in ${PYTHON:-} python3 .venv/bin/python python; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "$probe" >/dev/null 2>&1; then
        py="$candidate"
        break
    fi
done
if [ -z "$py" ]; then
    echo "gpu_e2e: no Python with torch and transformers$([ $need_cuda = 1 ] && echo ' and a CUDA device') found" \
         "(tried \$PYTHON, python3, .venv/bin/python, python)" >&2
    exit 2
fi
echo "gpu_e2e: using $py ($("$py" -c 'import sys; print(sys.executable)'))"
exec "$py" benchmarks/gpu_e2e.py "$@"
