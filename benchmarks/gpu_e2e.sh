#!/usr/bin/env bash
# GPU end-to-end benchmark: original vs folded vs folded+fused GPT-2 / OPT-125M-class /
# BERT-base-class in fp16, batch 1 and 8, sequence 128 to 4096, eager, CUDA graphs and
# torch.compile (< 5 minutes on one GPU: a time budget inside skips and lists what does not fit).
# Installs nothing: runs the source tree (PYTHONPATH=src) with the first Python that has torch
# (with CUDA, unless --dry-run) and transformers.
#   bash benchmarks/gpu_e2e.sh             # tables into $OUT if set, else benchmarks/results/
#   bash benchmarks/gpu_e2e.sh --dry-run   # the same code path on the CPU with tiny configs
set -euo pipefail
source "$(dirname "$0")/_gpu_python.sh"
gpu_python gpu_e2e "torch, transformers" "$@"
exec "$py" benchmarks/gpu_e2e.py "$@"
