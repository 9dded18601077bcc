#!/usr/bin/env bash
# Device call: which attention backends exist, then short real-schedule runs with flex and varlen. Results under $OUT.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
DATA=/tmp/syn
[ -e $DATA/fineweb_val_000000.bin ] || python3 data/synthetic.py --out $DATA --train_shards 1 --shard_tokens 100000000 --val_tokens 10485762 --seed 0 > $OUT/synthetic.txt 2>&1
python3 -c "import torch, train_gpt as t; print('backends', t.available_attn_backends(torch.device('cuda')))"
for be in ${BACKENDS:-flex varlen}; do
  mkdir -p $OUT/$be
  timeout ${TRAIN_S:-270} ./run.sh --train_files="$DATA/fineweb_train_*.bin" --val_files="$DATA/fineweb_val_*.bin" \
    --num_scheduled_iterations=${NS:-60} --num_extension_iterations=10 --val_loss_every=0 --log_dir=$OUT/$be \
    --attn_backend=$be "$@" > $OUT/$be/console.txt 2>&1
  echo "== $be rc=$?"; grep -E "Error|error:" $OUT/$be/console.txt | tail -4
  python3 bench/phase_times.py $OUT/$be/*-*.txt 2>&1 | tail -12
done
