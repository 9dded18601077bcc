#!/usr/bin/env bash
# One device call on 1xH100: GPU tests, kernel / attention / optimizer benchmarks. Results under $OUT (or ./out).
# Usage (device tool): bash bench/device_h100.sh
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{ nvidia-smi; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } 2>&1 | tee "$OUT/env.txt"
timeout 300 python3 -m pytest -q -m gpu tests -x -p no:cacheprovider 2>&1 | tail -40 | tee "$OUT/gpu_tests.txt"
timeout 240 python3 bench/kernels.py --out "$OUT/kernels.txt" 2>&1 | tail -60
timeout 150 python3 bench/attention.py 2>&1 | tail -40 | tee "$OUT/attention.txt"
timeout 120 python3 -m torch.distributed.run --standalone --nproc_per_node=1 bench/optimizer.py 2>&1 | tail -20 | tee "$OUT/optimizer.txt"
