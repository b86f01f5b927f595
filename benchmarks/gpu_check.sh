#!/usr/bin/env bash
# GPU check of normfold's Triton kernels: correctness vs the fp64 reference, then speed vs
# torch's native norms, a torch.compile'd RMSNorm and a device-to-device copy (< 4 minutes on
# one GPU). Installs nothing: it runs the source tree (PYTHONPATH=src) with the first Python
# that has torch (with CUDA, unless --dry-run) and triton.
#   bash benchmarks/gpu_check.sh             # tables into $OUT if set, else benchmarks/results/
#   bash benchmarks/gpu_check.sh --dry-run   # the same code path on the CPU (Triton interpreter)
set -euo pipefail
source "$(dirname "$0")/_gpu_python.sh"
gpu_python gpu_check "torch, triton" "$@"
exec "$py" benchmarks/gpu_check.py "$@"
