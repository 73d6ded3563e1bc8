#!/usr/bin/env bash
# The one command to run on a lent GPU machine (the device tool's `run`), from the repository root:
#   bash benchmarks/gpu/check.sh [--quick] [gpu_check flags]
# Nothing is installed there: kernels/ is linked where the install would put it (fastattn.kernels)
# and the image's python3 (CUDA torch, Triton) runs python -m fastattn.tools.gpu_check, without the C++
# extension (its CPU kernels do not matter on the GPU). It prints the versions first (a failure
# names them), then the report lands under $OUT/gpu_check case by case; commit it as
# benchmarks/gpu/<GPU name>.md. --quick is the 4-minute profile: a first look, a fix, a rerun.
# The full profile (about 11½ minutes) is more than one 10-minute command: run it as two,
# --part 1 (environment, correctness, determinism, large, attention) and --part 2 (fused,
# training, decoding, sanitizer, registers), each under the timeout below.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -e fastattn/kernels ] || ln -s ../kernels fastattn/kernels
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c 'import platform, torch, triton, numpy
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}),"
      f" triton {triton.__version__}, numpy {numpy.__version__}")' || true
exec timeout 590 python3 -m fastattn.tools.gpu_check --out "${OUT:-.}/gpu_check" "$@"
