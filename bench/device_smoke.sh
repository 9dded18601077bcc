#!/usr/bin/env bash
# Device call: GPU tests, then a shortened real-schedule run on synthetic data. Results under $OUT.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
DATA=/tmp/syn
(python3 data/synthetic.py --out $DATA --train_shards 1 --shard_tokens 100000000 --val_tokens 10485762 --seed 0 > $OUT/synthetic.txt 2>&1) &
timeout ${TEST_S:-200} python3 -m pytest -q -m gpu tests -p no:cacheprovider > $OUT/gpu_tests.txt 2>&1
grep -E "passed|failed|Error|error" $OUT/gpu_tests.txt | tail -25
wait
tail -2 $OUT/synthetic.txt
timeout ${TRAIN_S:-330} ./run.sh --train_files="$DATA/fineweb_train_*.bin" --val_files="$DATA/fineweb_val_*.bin" \
  --num_scheduled_iterations=${NS:-150} --num_extension_iterations=10 --val_loss_every=50 --log_dir=$OUT "$@" > $OUT/train_console.txt 2>&1
echo "train rc=$?"; grep -v "train_time.*step_avg" $OUT/train_console.txt | tail -25; grep "step:" $OUT/train_console.txt | tail -3
python3 bench/phase_times.py $OUT/*-*.txt 2>&1 | tail -15
