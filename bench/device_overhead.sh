#!/usr/bin/env bash
# Device call (1xH100): cost of the timed loop's NaN check (issue 7). The same shortened run twice, with the check
# off (--nonfinite_check_every=0, the loop without it) and on (the default, 25); compare ms/step per phase.
# The second run reuses the first one's inductor cache, so its warmup is shorter; the timed loop is unaffected.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
DATA=/tmp/syn
[ -e $DATA/fineweb_val_000000.bin ] || python3 data/synthetic.py --out $DATA --train_shards 1 --shard_tokens 100000000 \
  --val_tokens 10485762 --seed 0 > $OUT/synthetic.txt 2>&1
for every in ${CHECKS:-0 25}; do
  mkdir -p $OUT/check$every
  timeout ${TRAIN_S:-280} ./run.sh --train_files="$DATA/fineweb_train_*.bin" --val_files="$DATA/fineweb_val_*.bin" \
    --num_scheduled_iterations=${NS:-90} --num_extension_iterations=6 --val_loss_every=0 --seed=0 \
    --nonfinite_check_every=$every --log_dir=$OUT/check$every "$@" > $OUT/check$every/console.txt 2>&1
  echo "== nonfinite_check_every=$every rc=$?"; grep -E "Error|error:" $OUT/check$every/console.txt | tail -4
  python3 bench/phase_times.py $OUT/check$every/*-*.txt 2>&1 | tail -9
done
