#!/usr/bin/env bash
# GPU check of normfold's Triton kernels: correctness vs the fp64 reference, then speed vs
# torch's native norms, a torch.compile'd RMSNorm and a device-to-device copy (< 4 minutes on
# one GPU). Installs nothing: it runs the source tree (PYTHONPATH=src) with the first Python
# that has torch (with CUDA, unless --dry-run) and triton.
#   bash benchmarks/gpu_check.sh             # tables into $OUT if set, else benchmarks/results/
#   bash benchmarks/gpu_check.sh --dry-run   # the same code path on the CPU (Triton interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1  # progress lines reach a remote log as they happen

need_cuda=1
for arg in "$@"; do [ "$arg" = "--dry-run" ] && need_cuda=0; done
probe="import torch, triton; assert $need_cuda == 0 or torch.cuda.is_available()"

py=""
for candidate in ${PYTHON:-} python3 .venv/bin/python python; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "$probe" >/dev/null 2>&1; then
        py="$candidate"
        break
    fi
done
if [ -z "$py" ]; then
    echo "gpu_check: no Python with torch and triton$([ $need_cuda = 1 ] && echo ' and a CUDA device') found" \
         "(tried \$PYTHON, python3, .venv/bin/python, python)" >&2
    exit 2
fi
echo "gpu_check: using $py ($("$py" -c 'import sys; print(sys.executable)'))"
exec "$py" benchmarks/gpu_check.py "$@"
