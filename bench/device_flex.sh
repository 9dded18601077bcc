#!/usr/bin/env bash
# Device call (1xH100): the attention GPU tests, then a short real-schedule run with --attn_backend=flex.
# Usage on the device: OUT=out NS=60 bash bench/device_flex.sh ; results under $OUT.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
DATA=/tmp/syn
[ -e $DATA/fineweb_val_000000.bin ] || (python3 data/synthetic.py --out $DATA --train_shards 1 --shard_tokens 100000000 \
  --val_tokens 10485762 --seed 0 > $OUT/synthetic.txt 2>&1) &
timeout ${TEST_S:-200} python3 -m pytest -q -s -m gpu tests/test_attention.py -p no:cacheprovider > $OUT/attention_gpu.txt 2>&1
echo "attention gpu tests rc=$?"; grep -E "passed|failed|Error" $OUT/attention_gpu.txt | tail -8
wait
BACKENDS=flex NS=${NS:-60} TRAIN_S=${TRAIN_S:-360} OUT=$OUT bash bench/device_train2.sh
