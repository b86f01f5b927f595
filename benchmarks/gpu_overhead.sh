#!/usr/bin/env bash
# Where a norm call's time goes on a GPU: host µs per call down to the raw Triton launch, the
# fwd+bwd kernels of the public op, torch.compile's graphs on a folded GPT-2 (~2 minutes on one GPU).
# Installs nothing: runs the source tree (PYTHONPATH=src) with the first Python that has torch
# (with CUDA, unless --dry-run), triton and transformers.
#   bash benchmarks/gpu_overhead.sh             # gpu_overhead.md into $OUT if set, else benchmarks/results/
#   bash benchmarks/gpu_overhead.sh --dry-run   # the same code path on the CPU
set -euo pipefail
source "$(dirname "$0")/_gpu_python.sh"
gpu_python gpu_overhead "torch, transformers" "$@"
exec "$py" benchmarks/gpu_overhead.py "$@"
