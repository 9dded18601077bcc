#!/usr/bin/env bash
# Two torchrun "nodes" of 2 GPUs each on one 4-GPU machine (c10d rendezvous on localhost, as ./run.sh starts nodes)
# against one 4-GPU ./run.sh: the same NS (default 60) + 6 steps, seed and synthetic data; then the validation lines
# and bench/phase_times.py's table of the two logs. OPTIONs (--name=value) go to both runs.
#   notes/2026-11-26_two_nodes_4xH200/two_nodes.sh [OPTION ...]
#   (OUT: results folder, default ./out; DATA: synthetic shards)
set -euo pipefail
cd "$(dirname "$0")/../.."   # the repository root (this file is in notes/<folder>/)
OUT=${OUT:-out}; DATA=${DATA:-/tmp/syn_bench}; PY=${PYTHON:-python3}
case "$OUT" in /*) ;; *) OUT="$PWD/$OUT" ;; esac
mkdir -p "$OUT"
[ -e "$DATA/fineweb_val_000000.bin" ] || "$PY" data/synthetic.py --out "$DATA" --preset=bench > "$OUT/synthetic.txt"
opts=(--train_files="$DATA/fineweb_train_*.bin" --val_files="$DATA/fineweb_val_*.bin"
      --num_scheduled_iterations="${NS:-60}" --num_extension_iterations=6 --val_loss_every=20 --seed=0 "$@")
echo "== one node, 4 GPUs: NPROC=4 ./run.sh ... --run_id=one"
NPROC=4 ./run.sh "${opts[@]}" --log_dir="$OUT/one" --run_id=one > "$OUT/one_console.txt" 2>&1 || echo "exit $?"
echo "== two nodes of 2 GPUs: CUDA_VISIBLE_DEVICES=0,1 (then 2,3) NNODES=2 NPROC=2 MASTER_ADDR=127.0.0.1 ./run.sh ..."
pids=()
for node in 0 1; do
  CUDA_VISIBLE_DEVICES=$((2 * node)),$((2 * node + 1)) NNODES=2 NPROC=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29517 \
    ./run.sh "${opts[@]}" --log_dir="$OUT/two" --run_id=two > "$OUT/two_node$node.txt" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || echo "a node exited with $?"; done
for run in one two; do echo "-- $run"; grep -hE "^step:.*val_loss|^result:|^error" "$OUT/$run/$run.txt" || true; done
"$PY" bench/phase_times.py "$OUT/one/one.txt" "$OUT/two/two.txt" | sed -n '/^| |/,$p'
