#!/usr/bin/env bash
# GPU calibration on one lent GPU (device tool): expert GEMM vs tokens per expert at BF16 / FP8 (MXFP4 when
# the installed torch has a kernel for the GPU), the permutation kernel, and the distributed
# dispatch/combine check on the one GPU (world size 1, NCCL). Writes profiles + a summary to $OUT (or ./gpu-out).
# Usage (device tool, from the repository root):  bash kernels/gpu_check.sh
set -euo pipefail
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/nvidia-smi.csv"
timeout 240 python -m kernels.gpu_bench --out-dir "$OUT" --device cuda
timeout 120 python -m moeplace.cli kernels verify --world-size 1 --backend nccl | tee "$OUT/verify.txt"
