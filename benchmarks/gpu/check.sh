#!/usr/bin/env bash
# The one command to run on a lent GPU machine (the device tool's `run`), from the repository root:
#   bash benchmarks/gpu/check.sh
# Nothing is installed there: kernels/ is linked where the install would put it (fastattn.kernels)
# and the image's python3 (CUDA torch, Triton) runs python -m fastattn.gpu_check, without the C++
# extension (its CPU kernels do not matter on the GPU). The report lands under $OUT/gpu_check
# stage by stage; commit it as benchmarks/gpu/<GPU name>.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -e fastattn/kernels ] || ln -s ../kernels fastattn/kernels
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
exec timeout 590 python3 -m fastattn.gpu_check --out "${OUT:-.}/gpu_check" "$@"
