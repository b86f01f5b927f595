#!/usr/bin/env bash
# GPU training time of the norm variants (norm_comparison's width phase on CUDA: widths 384 and 1024,
# bf16 autocast and fp32, 5 paired seeds; a 90 s budget on one GPU). Installs nothing: runs the source
# tree (PYTHONPATH=src) with the first Python that has torch (with CUDA, unless --dry-run) and triton.
#   bash benchmarks/gpu_train.sh             # tables into $OUT if set, else experiments/results/
#   bash benchmarks/gpu_train.sh --dry-run   # the same code path on the CPU, norms on the Triton interpreter
set -euo pipefail
source "$(dirname "$0")/_gpu_python.sh"
gpu_python gpu_train "torch, triton" "$@"
exec "$py" benchmarks/gpu_train.py "$@"
