#!/usr/bin/env bash
# GPU benchmarks and shortened training runs, one command each; `bench/run.sh --help` lists them.
# Training runs go through ./run.sh on synthetic shards (made once in $DATA), so their loss says nothing about the
# 3.28 target; they measure time per step, compile time and memory.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: bench/run.sh COMMAND [ARGS ...]

commands:
  tests [PATH ...]   the GPU tests (pytest -m gpu) of PATHs, default tests/
  kernels            versions and nvidia-smi, the GPU tests (stop at the first failure), then bench/kernels.py,
                     bench/attention.py and bench/optimizer.py
  train [OPTION ...] a shortened run of the real schedule: NS scheduled steps (default 150) + 10 extension steps,
                     validation every 50, then its time per step in each batch phase (bench/phase_times.py)
  smoke [OPTION ...] the GPU tests (the data is made meanwhile), then train
  backends [OPTION ...]
                     the attention backends this machine has, then NS (default 60) + 10 steps with each backend in
                     BACKENDS (default "triton varlen")
  overhead [OPTION ...]
                     the cost of the NaN check: NS (default 90) + 6 steps with each --nonfinite_check_every in
                     CHECKS (default "0 25": off, and the default)
  resume [OPTION ...]
                     exact resume: NS (default 30) + 4 steps with a checkpoint every NS/2 steps, then the same run
                     resumed from the first checkpoint (across a window change and the untie); compares the final
                     states bit for bit (bench/compare_states.py) and the validation lines
  profile [OPTION ...]
                     GPU time per bucket of a step late in each batch phase of an NS-step run (default 60;
                     bench/profile_step.py --run)
  rank8 [OPTION ...]  an 8-GPU run's step as each of its ranks sees it, on this node's NPROC GPUs: every batch (the
                     stages', the validation's) cut to NPROC/8 of its size and one micro-batch per GPU
                     (--batch_slices=NPROC), so each GPU runs one micro-batch of the 8-GPU size per step, then the
                     optimizer. NS (default 60) + 6 steps, then the same under bench/profile_step.py --run, with
                     every GPU's clock and power logged throughout (bench/gpu_clocks.py). For the time per step
                     only: the smaller batch is not the record's math
  full BASE [OPTION ...]
                     the whole default schedule (1270 + 15 steps), seed 0: each run in RUNS (default "base new", and
                     "extra" when EXTRA is set; "base" is the code in the folder BASE, "new" this code, "extra" this
                     code with EXTRA's options), then bench/phase_times.py's table of the runs made. On 4 GPUs a run
                     takes about 5 minutes: split the runs over consecutive calls (RUNS=base, then RUNS=new) and
                     compare the logs afterwards with phase_times.py
  ab BASE [OPTION ...]
                     before/after, both in this call: NS (default 60) + 6 steps of the code in the folder BASE (a
                     checkout of the baseline, e.g. `git worktree add /tmp/base <commit>`), then the same run of this
                     code (seed 0, validation every 20), then bench/phase_times.py's table of the two: ms/step per
                     batch phase with the ratio to BASE, last validation, peak memory. Both runs share torch's
                     caches, whose keys see the graphs, triton_kernels.py and the trainer's graph pass; to measure a
                     change they do not see (an inductor heuristic), run each tree's bench/run.sh backends under its
                     own TORCHINDUCTOR_CACHE_DIR. EXTRA="--name=value ..." adds a third run of this code with
                     those options (e.g. EXTRA=--kernels=mlp:torch), in the same table. RUNS picks runs as for full
  startup [OPTION ...]
                     start-up times: NS (default 30) + 3 steps three times with torch's caches in $OUT/startup_cache:
                     cold (no caches, no compile cache file), second (everything kept), fresh (only the compile cache
                     file, as on a new node); each run's start-up lines and compile summary, then its time per step.
                     RUNS picks some of them (default "cold second fresh"); SAMPLE=1 runs the second one under
                     bench/stack_sampler.py (one GPU only)

OPTIONs are train_gpt.py's --name=value and go to every training run. Each step's output is kept in $OUT (default
./out), with the training logs; the console gets a summary. The exit status is the first failed step's.

environment:
  OUT       results folder (default ./out)
  DATA      synthetic shards (default /tmp/syn_bench, or /tmp/syn_full for full), made with `data/synthetic.py
            --preset=bench` (full: --preset=full, the 7 shards the whole schedule reads) unless it holds a val shard;
            give another folder rather than one with shards of other sizes
  NPROC     GPUs to use (./run.sh's default: all of them, if their count divides 8)
  NS, BACKENDS, CHECKS, RUNS, SAMPLE   see the commands
  LIMIT_S   a time limit in seconds for each step (default none)
  SMI       the nvidia-smi that logs the GPUs' clocks (rank8; default nvidia-smi, empty: no log)

example: the attention tests, then a run with torch's varlen attention
  bench/run.sh tests tests/test_attention.py && BACKENDS=varlen bench/run.sh backends
EOF
}

COMMANDS="tests kernels train smoke backends overhead resume profile rank8 full ab startup"
command=${1:-}
case "$command" in
  -h|--help|help) usage; exit 0 ;;
  "") usage >&2; exit 2 ;;
esac
shift
if [[ " $COMMANDS " != *" $command "* ]]; then
  echo "error: unknown command '$command'; use one of: $COMMANDS (bench/run.sh --help)" >&2
  exit 2
fi
if { [ "$command" = ab ] || [ "$command" = full ]; } && { [ $# -eq 0 ] || [ ! -x "$1/run.sh" ]; }; then
  echo "error: '$command' needs the baseline's folder first, one with run.sh (got '${1:-}'):" \
    "git worktree add /tmp/base <commit>, then bench/run.sh $command /tmp/base" >&2
  exit 2
fi
if [ "$command" = kernels ] && [ $# -gt 0 ]; then
  echo "error: 'kernels' takes no arguments, got: $*; the benchmarks use their built-in shapes" >&2
  exit 2
fi

OUT=${OUT:-out}
preset=bench   # one 100M-token shard: enough for every shortened run, not for the whole schedule's 468M tokens
[ "$command" = full ] && preset=full
DATA=${DATA:-/tmp/syn_$preset}
# absolute paths: the commands below run from the repository root
case "$OUT" in /*) ;; *) OUT="$PWD/$OUT" ;; esac
case "$DATA" in /*) ;; *) DATA="$PWD/$DATA" ;; esac
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
status=0

# step NAME CMD ...: runs CMD with its output in $OUT/NAME.txt and reports its exit status. A failed step does not stop
# the later ones (each measures something of its own); the script exits with the first failure's status.
step() {
  local name=$1 rc=0
  shift
  if [ -n "${LIMIT_S:-}" ]; then
    timeout "$LIMIT_S" "$@" > "$OUT/$name.txt" 2>&1 || rc=$?
  else
    "$@" > "$OUT/$name.txt" 2>&1 || rc=$?
  fi
  echo "== $name: exit $rc ($OUT/$name.txt)"
  if [ "$status" -eq 0 ]; then status=$rc; fi
}

# The synthetic shards. synthetic.py moves a complete set into place at once, so a val shard means the set is whole.
make_data() {
  [ -e "$DATA/fineweb_val_000000.bin" ] && return 0
  if ! "$PY" data/synthetic.py --out "$DATA" --preset="$preset" > "$OUT/synthetic.txt" 2>&1; then
    echo "error: making synthetic shards in $DATA failed: see $OUT/synthetic.txt" >&2
    return 1
  fi
}

# clocks_start NAME / clocks_stop NAME: log every GPU's clock, power and throttle reasons to $OUT/NAME.csv every 200 ms
# in between (with $SMI, default nvidia-smi; SMI= turns it off), then print bench/gpu_clocks.py's summary of it
clocks_start() {
  clocks_pid=
  local smi=${SMI-nvidia-smi}
  [ -n "$smi" ] && command -v "$smi" > /dev/null || return 0
  "$smi" --query-gpu=index,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv,noheader,nounits -lms 200 > "$OUT/$1.csv" 2> /dev/null &
  clocks_pid=$!
}

clocks_stop() {
  [ -n "${clocks_pid:-}" ] || return 0
  kill "$clocks_pid" 2> /dev/null || true
  wait "$clocks_pid" 2> /dev/null || true
  "$PY" bench/gpu_clocks.py "$OUT/$1.csv" || true
}

gpu_tests() {
  step gpu_tests "$PY" -m pytest -q -m gpu -p no:cacheprovider "$@"
  grep -E "passed|failed|skipped|error" "$OUT/gpu_tests.txt" | tail -25 || true
}

# newest_log DIR: the training log a run just wrote in DIR (the newest .txt that is not the console's)
newest_log() {
  ls -t "$1"/*.txt 2>/dev/null | grep -v '/console\.txt$' | head -1 || true
}

# train_run NAME [OPTION ...]: ./run.sh (or $RUNSH) on the synthetic shards with its log in $OUT/NAME/, then a summary
# of that log
train_run() {
  local name=$1 log
  shift
  mkdir -p "$OUT/$name"
  step "$name/console" "${RUNSH:-./run.sh}" --train_files="$DATA/fineweb_train_*.bin" \
    --val_files="$DATA/fineweb_val_*.bin" --log_dir="$OUT/$name" "$@"
  grep -E "error:|Error|val_loss|^result:" "$OUT/$name/console.txt" | tail -12 || true
  log=$(newest_log "$OUT/$name")
  if [ -n "$log" ]; then "$PY" bench/phase_times.py "$log" || true; fi
}

# compare_runs NAME ...: bench/phase_times.py's before/after table of the named runs' logs (the first is the baseline)
compare_runs() {
  local run log logs=()
  for run in "$@"; do
    log=$(newest_log "$OUT/$run")
    if [ -n "$log" ]; then logs+=("$log"); fi
  done
  if [ "${#logs[@]}" -ge 2 ]; then
    "$PY" bench/phase_times.py "${logs[@]}" | sed -n '/^| |/,$p'
  fi
}

case "$command" in
  tests)
    gpu_tests "${@:-tests}" ;;
  kernels)
    { nvidia-smi; "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
      > "$OUT/env.txt" 2>&1 || true
    tail -3 "$OUT/env.txt"
    gpu_tests -x tests
    step kernels "$PY" bench/kernels.py
    tail -60 "$OUT/kernels.txt"
    step attention "$PY" bench/attention.py
    tail -40 "$OUT/attention.txt"
    step optimizer "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 bench/optimizer.py
    tail -20 "$OUT/optimizer.txt" ;;
  train)
    make_data
    train_run train --num_scheduled_iterations="${NS:-150}" --num_extension_iterations=10 --val_loss_every=50 "$@" ;;
  smoke)
    make_data & data_pid=$!
    gpu_tests tests
    wait "$data_pid"
    train_run train --num_scheduled_iterations="${NS:-150}" --num_extension_iterations=10 --val_loss_every=50 "$@" ;;
  backends)
    make_data
    "$PY" -c "import torch, train_gpt as t; print('backends:', t.available_attn_backends(torch.device('cuda')))" || true
    for backend in ${BACKENDS:-triton varlen}; do
      train_run "$backend" --num_scheduled_iterations="${NS:-60}" --num_extension_iterations=10 --val_loss_every=0 \
        --attn_backend="$backend" "$@"
    done ;;
  overhead)
    make_data
    # the later runs reuse the first one's inductor cache: a shorter warmup, the same timed loop
    for every in ${CHECKS:-0 25}; do
      train_run "check$every" --num_scheduled_iterations="${NS:-90}" --num_extension_iterations=6 --val_loss_every=0 \
        --seed=0 --nonfinite_check_every="$every" "$@"
    done ;;
  resume)
    make_data
    ns=${NS:-30}
    every=$((ns / 2))
    opts=(--num_scheduled_iterations="$ns" --num_extension_iterations=4 --val_loss_every=10 --seed=0
          --checkpoint_every="$every" --save_checkpoint "$@")
    train_run straight "${opts[@]}" --run_id=straight
    first=$(printf 'state_step%06d' "$every")
    train_run resumed "${opts[@]}" --run_id=resumed --resume="$OUT/straight/straight/$first.pt"
    final=$(printf 'state_step%06d' $((ns + 4)))
    suffix=""
    [ -e "$OUT/straight/straight/$final.pt" ] || suffix="_rank0"
    step compare "$PY" bench/compare_states.py "$OUT/straight/straight/$final$suffix.pt" \
      "$OUT/resumed/resumed/$final$suffix.pt"
    cat "$OUT/compare.txt"
    for run in straight resumed; do grep -h "^step:.*val_loss" "$OUT/$run/$run.txt" || true; done ;;
  profile)
    make_data
    step profile "$PY" bench/profile_step.py --run --out="$OUT/profile" --scheduled="${NS:-60}" \
      --train_files="$DATA/fineweb_train_*.bin" --val_files="$DATA/fineweb_val_*.bin" "$@"
    grep -E "^\||error" "$OUT/profile.txt" || true ;;
  rank8)
    gpus=${NPROC:-$("$PY" -c "import torch; print(torch.cuda.device_count())")}
    case "$gpus" in 1|2|4|8) ;; *)
      echo "error: rank8 needs a GPU count that divides 8, got $gpus: set NPROC to 1, 2, 4 or 8" >&2; exit 2 ;;
    esac
    export NPROC=$gpus
    # the default batches (stages, validation) at NPROC/8 of their size; the stages as --stages reads them
    # shellcheck disable=SC2207  # options without spaces or wildcards, one per word
    shape=($("$PY" -c 'import dataclasses, sys, harness, train_gpt as t
n, hp = int(sys.argv[1]), t.Hyperparameters()
stages = harness.show(tuple(dataclasses.replace(s, batch=s.batch * n // 8) for s in hp.stages))
print(f"--batch_slices={n} --stages={stages} --val_batch_size={hp.val_batch_size * n // 8}")' "$gpus"))
    make_data
    clocks_start rank8_clocks
    train_run rank8 --num_scheduled_iterations="${NS:-60}" --num_extension_iterations=6 --val_loss_every=0 \
      "${shape[@]}" "$@"
    step rank8_profile "$PY" bench/profile_step.py --run --out="$OUT/rank8_profile" --scheduled="${NS:-60}" \
      --train_files="$DATA/fineweb_train_*.bin" --val_files="$DATA/fineweb_val_*.bin" "${shape[@]}" "$@"
    grep -E "^\||error|rank[0-9]+ \+" "$OUT/rank8_profile.txt" || true
    clocks_stop rank8_clocks ;;
  full|ab)
    base=$(cd "$1" && pwd)
    shift
    runs=${RUNS:-base new${EXTRA:+ extra}}
    for run in $runs; do
      case "$run" in base|new|extra) ;; *) echo "error: RUNS takes base, new and extra, got '$run'" >&2; exit 2 ;; esac
    done
    opts=(--seed=0 "$@")
    if [ "$command" = ab ]; then
      opts=(--num_scheduled_iterations="${NS:-60}" --num_extension_iterations=6 --val_loss_every=20 "${opts[@]}")
    fi
    make_data
    for run in $runs; do
      case "$run" in
        base) RUNSH="$base/run.sh" train_run base "${opts[@]}" ;;
        new) train_run new "${opts[@]}" ;;
        # shellcheck disable=SC2086  # EXTRA holds options separated by spaces
        extra) train_run extra "${opts[@]}" $EXTRA ;;
      esac
    done
    # shellcheck disable=SC2086  # the run names, separated by spaces
    compare_runs $runs ;;
  startup)
    make_data
    cache="$OUT/startup_cache"
    rm -rf "$cache"
    export TORCHINDUCTOR_CACHE_DIR="$cache/inductor" TRITON_CACHE_DIR="$cache/triton"
    opts=(--num_scheduled_iterations="${NS:-30}" --num_extension_iterations=3 --val_loss_every=0
          --compile_cache="$cache/compile_cache.bin" "$@")
    for run in ${RUNS:-cold second fresh}; do
      [ "$run" = fresh ] && rm -rf "$cache/inductor" "$cache/triton"
      if [ "$run" = second ] && [ -n "${SAMPLE:-}" ]; then
        mkdir -p "$OUT/second"
        step second/console "$PY" bench/stack_sampler.py --out="$OUT/second/stacks.txt" -- train_gpt.py \
          --train_files="$DATA/fineweb_train_*.bin" --val_files="$DATA/fineweb_val_*.bin" \
          --log_dir="$OUT/second" "${opts[@]}"
      else
        train_run "$run" "${opts[@]}"
      fi
      grep -hE "^phase:(startup|warmup|process_start)|^compile:|^compile cache" "$OUT/$run/console.txt" || true
    done ;;
esac
exit "$status"
