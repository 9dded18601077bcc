#!/usr/bin/env bash
# One device call: make synthetic data, then a shortened run of the real schedule through run.sh.
# Usage: NPROC=1 bash bench/device_train.sh [extra --name=value ...]     Results under $OUT (or ./out).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
DATA=${DATA:-/tmp/syn}
[ -e "$DATA/fineweb_val_000000.bin" ] || python3 data/synthetic.py --out "$DATA" --train_shards 1 \
    --shard_tokens 100000000 --val_tokens 10485762 --seed 0 2>&1 | tail -3
./run.sh --train_files="$DATA/fineweb_train_*.bin" --val_files="$DATA/fineweb_val_*.bin" \
    --num_scheduled_iterations=150 --num_extension_iterations=10 --val_loss_every=50 --log_dir="$OUT" "$@" 2>&1 \
    | grep -v "^step:[0-9]*/160 train_time" | tail -40
python3 bench/phase_times.py "$OUT"/*.txt 2>&1 | tee "$OUT/phases.txt"
