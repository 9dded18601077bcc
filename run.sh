#!/usr/bin/env bash
# Train the record model on this node's GPUs:  ./run.sh [--name=value ...]   (options: see Hyperparameters in train_gpt.py)
# NPROC=4 ./run.sh uses 4 GPUs; the math is the same on 1, 2, 4 or 8 (gradient accumulation keeps the global batch).
# Several nodes: the same command on each, NNODES=2 MASTER_ADDR=<an address of the first node> ./run.sh (torchrun's
# c10d rendezvous at MASTER_ADDR:MASTER_PORT, default port 29500; every node uses NPROC GPUs, default all it has;
# LOCAL_ADDR: this node's address as the others reach it; RDZV_TIMEOUT: seconds to wait for the slowest node).
# Steps: check the process count, count the GPUs (without torch when it is not installed yet), install what is missing,
# fetch the FineWeb shards the default schedule reads (unless --train_files is given), start torchrun. What cannot run
# here is said first: a machine without a GPU stops before anything is installed or downloaded (the shards alone, on
# any machine: python3 data/cached_fineweb10B.py). requirements.txt bounds torch and triton to the tested versions;
# run.sh installs only when an import fails, so a torch installed beforehand (a newer one: untested) is used as it is.
# TRAIN=my_idea.py ./run.sh trains a copy of train_gpt.py instead (a path from where run.sh is started, or from here).
set -euo pipefail
started_in=$PWD
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
train_named=${TRAIN:-train_gpt.py}      # as given, for the messages
if [ -n "${TRAIN:-}" ] && [ "${TRAIN#/}" = "$TRAIN" ] && [ -f "$started_in/$TRAIN" ]; then
  TRAIN="$started_in/$TRAIN"
fi
TRAIN=${TRAIN:-train_gpt.py}
if [ ! -f "$TRAIN" ]; then
  echo "run.sh: error: TRAIN=$TRAIN is not a file; set TRAIN to the training script to run (default train_gpt.py)," \
       "e.g. cp train_gpt.py my_idea.py && TRAIN=my_idea.py ./run.sh" >&2
  exit 1
fi

for arg in "$@"; do
  case "$arg" in
    --help|-h)
      cat <<USAGE
usage: [TRAIN=script.py] [NPROC=n] [NNODES=n MASTER_ADDR=host [MASTER_PORT=p] [LOCAL_ADDR=a] [RDZV_TIMEOUT=s]] \\
       ./run.sh [--name=value ...]
Counts this node's GPUs (none: it says so and stops before it installs or fetches anything), installs what is
missing at the tested versions (requirements.txt), fetches the FineWeb shards the default schedule reads (unless
--train_files is given) and starts torchrun over the GPUs.
  TRAIN         the training script (default train_gpt.py; a copy of it runs itself: cp train_gpt.py my_idea.py,
                edit, TRAIN=my_idea.py ./run.sh)
  NPROC         GPUs to use on this node (1, 2, 4 or 8; default: all, up to 8)
  NNODES, MASTER_ADDR, MASTER_PORT, LOCAL_ADDR, RDZV_TIMEOUT
                several nodes: the same command on each (README, docs/multi-node.md)
  PYTHON        the Python to use (default python3)
The script's own options (--name=value) follow.
USAGE
      # The script imports its requirements before it can list its options: on a bare machine, say how to get them.
      if help=$("$PY" "$TRAIN" --help 2>&1); then printf '%s\n' "$help"; exit 0; fi
      if printf '%s\n' "$help" | grep -q '^ModuleNotFoundError'; then
        echo "(they are listed once its requirements are installed, $PY -m pip install -r requirements.txt, by" \
             "$PY $train_named --help; here: $(printf '%s\n' "$help" | tail -n 1))"
        exit 0
      fi
      printf '%s\n' "$help" >&2
      exit 1 ;;
  esac
done

if [ -n "${NPROC:-}" ]; then
  case "$NPROC" in 1|2|4|8) ;; *) echo "run.sh: error: NPROC=$NPROC must divide 8 (1, 2, 4 or 8)" >&2; exit 1;; esac
fi
NNODES=${NNODES:-1}
case "$NNODES" in ''|*[!0-9]*|0) echo "run.sh: error: NNODES=$NNODES must be a node count (1, 2, ...)" >&2; exit 1;; esac
if [ "$NNODES" -gt 1 ] && [ -z "${MASTER_ADDR:-}" ]; then
  echo "run.sh: error: NNODES=$NNODES needs MASTER_ADDR, an address of the first node that every node can reach" \
       "(the same command on every node: NNODES=$NNODES MASTER_ADDR=10.0.0.1 ./run.sh)" >&2
  exit 1
fi
RDZV_TIMEOUT=${RDZV_TIMEOUT:-1800}
case "$RDZV_TIMEOUT" in ''|*[!0-9]*|0*) echo "run.sh: error: RDZV_TIMEOUT=$RDZV_TIMEOUT must be whole seconds (e.g." \
  "RDZV_TIMEOUT=3600 to wait an hour for the slowest node)" >&2; exit 1;; esac

# Processes in all: 1, 2, 4 or 8 (the record's math) or 16, 32 or 64 (one batch slice each), the counts the trainer is
# tested for; any other is refused here, not after every node has downloaded and met (or the ranks refused it).
check_world() {
  local world=$((NNODES * NPROC)) n p nodes="" procs=""
  case "$world" in 1|2|4|8|16|32|64) return 0 ;; esac
  for n in 1 2 4 8 16 32 64; do      # the node counts nearest NNODES that work with this NPROC
    [ $((n * NPROC)) -le 64 ] || break
    if [ "$n" -lt "$NNODES" ]; then nodes="NNODES=$n"; fi
    if [ "$n" -gt "$NNODES" ]; then nodes="${nodes:+$nodes or }NNODES=$n"; break; fi
  done
  for p in 8 4 2 1; do               # else an NPROC that works with these NNODES
    case $((NNODES * p)) in 1|2|4|8|16|32|64) procs="NPROC=$p (with NNODES=$NNODES)"; break ;; esac
  done
  echo "run.sh: error: NNODES=$NNODES x NPROC=$NPROC = $world processes, but a run takes 1, 2, 4, 8, 16, 32 or 64:" \
       "set ${nodes:+$nodes (with NPROC=$NPROC)}${nodes:+${procs:+, or }}$procs" >&2
  exit 1
}
if [ -n "${NPROC:-}" ]; then check_world; fi

# The GPUs are counted before anything is installed or downloaded: none at all ends run.sh here (a dry run too: its
# checks are the GPU run's). With torch importable, torch counts; before torch is installed, the driver does
# (nvidia-smi -L, else the /dev/nvidia<n> device files), CUDA_VISIBLE_DEVICES empty meaning none, and torch counts
# again after the install. Without NPROC, the count sets the processes per node that check_world must see.
count_gpus_with_torch() {
  "$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null
}
count_gpus_without_torch() {      # sets NGPU, and why_none for when it is 0
  local d
  NGPU=0
  if command -v nvidia-smi >/dev/null 2>&1; then
    NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ') || NGPU=0
    why_none="nvidia-smi -L lists none"
  else
    for d in /dev/nvidia[0-9]*; do [ -e "$d" ] && NGPU=$((NGPU + 1)); done
    why_none="no nvidia-smi and no /dev/nvidia<n> device"
  fi
  if hidden; then NGPU=0; why_none="CUDA_VISIBLE_DEVICES='$CUDA_VISIBLE_DEVICES' selects none"; fi
}
hidden() {        # CUDA_VISIBLE_DEVICES selects no GPU (a list of ids narrows the count: torch's count says how far)
  [ -n "${CUDA_VISIBLE_DEVICES+set}" ] && case "$CUDA_VISIBLE_DEVICES" in ''|-*) true ;; *) false ;; esac
}
no_gpu() {
  echo "run.sh: error: no CUDA GPU found ($1); to train on this machine's CPU, see the README's" \
       "\"Try it on a CPU\": python3 $train_named --preset=tiny --train_files=... --val_files=..." >&2
  exit 1
}
torch_counted=yes
why_none="torch sees none: check nvidia-smi and CUDA_VISIBLE_DEVICES"
if hidden; then why_none="CUDA_VISIBLE_DEVICES='$CUDA_VISIBLE_DEVICES' selects none"; fi
if ! NGPU=$(count_gpus_with_torch); then torch_counted=no; count_gpus_without_torch; fi
case "$NGPU" in ''|*[!0-9]*) NGPU=0 ;; esac
if [ "$NGPU" -eq 0 ]; then no_gpu "$why_none; nothing was installed or downloaded"; fi

REQUIRED="torch, triton, numpy, tiktoken, huggingface_hub"
if ! "$PY" -c "import $REQUIRED" 2>/dev/null; then
  echo "run.sh: $PY cannot import one of $REQUIRED: installing them at the versions the project tests" \
       "(requirements.txt bounds torch and triton; torch with its CUDA libraries is a few GB):" \
       "$PY -m pip install -r requirements.txt"
  "$PY" -m pip install -r requirements.txt
  if ! "$PY" -c "import $REQUIRED" 2>/dev/null; then
    echo "run.sh: error: after installing requirements.txt, $PY still cannot import one of $REQUIRED" \
         "(see: $PY -c 'import $REQUIRED')" >&2
    exit 1
  fi
fi
if [ "$torch_counted" = no ]; then       # the driver's count was only 'some': torch's is the one torchrun sees
  before=$NGPU
  NGPU=$(count_gpus_with_torch) || NGPU=0
  case "$NGPU" in ''|*[!0-9]*) NGPU=0 ;; esac
  if [ "$NGPU" -eq 0 ]; then
    no_gpu "the driver lists $before, but the torch just installed sees none: a CPU build? CUDA_VISIBLE_DEVICES?"
  fi
fi
if [ -z "${NPROC:-}" ]; then
  for n in 8 4 2 1; do if [ "$NGPU" -ge "$n" ]; then NPROC=$n; break; fi; done
  if [ "$NPROC" -ne "$NGPU" ]; then
    echo "run.sh: $NGPU GPUs found; using $NPROC (the GPU count must divide 8). Set NPROC to choose."
  fi
  check_world
fi
if [ "$NPROC" -gt "$NGPU" ]; then echo "run.sh: error: NPROC=$NPROC but only $NGPU GPU(s) found" >&2; exit 1; fi

# Data: the default globs read data/fineweb10B/; --train_files (and --val_files) point elsewhere and skip this step.
own_data=no; fetch=yes
for arg in "$@"; do
  case "$arg" in
    --train_files=*|--train-files=*) own_data=yes ;;
    --dry_run|--dry-run|--dry_run=[tTyY1]*|--dry-run=[tTyY1]*|--dry_run=on|--dry-run=on) fetch=no ;;  # a dry run changes nothing
  esac
done
if [ "$own_data" = no ] && [ "$fetch" = yes ]; then
  # How many of the shards data/cached_fineweb10B.py fetches by default (the val shard, train shards 1..9) are missing
  # or invalid. The script itself skips the valid ones and resumes; should this count fail, the script just runs.
  missing=$("$PY" -c "
import os, sys
sys.path.insert(0, 'data')
import cached_fineweb10B as c, shards
names = c.shard_names(c.DEFAULT_TRAIN_SHARDS)
bad = [n for n in names if shards.check_shard(os.path.join('data', 'fineweb10B', n)) is not None]
print(f'{len(bad)} of the {len(names)}')" 2>/dev/null) || missing="some of the"
  if [ "${missing%% *}" != 0 ]; then
    echo "run.sh: data/fineweb10B/ lacks $missing shards the default schedule reads; fetching them (about 200 MB each): $PY data/cached_fineweb10B.py"
    rc=0
    "$PY" data/cached_fineweb10B.py || rc=$?
    if [ "$rc" -eq 130 ]; then exit 130; fi      # Ctrl-C: the script has said so; complete shards are kept
    if [ "$rc" -ne 0 ]; then
      echo "run.sh: error: the FineWeb shards could not be downloaded into data/fineweb10B/ (why: the error line above;" \
           "./run.sh again resumes). Without network, smoke-test on synthetic data:" \
           "python3 data/synthetic.py --out data/synthetic --preset=full then" \
           "./run.sh --train_files='data/synthetic/fineweb_train_*.bin' --val_files='data/synthetic/fineweb_val_*.bin'" >&2
      exit 1
    fi
  fi
fi

export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # what torchrun gives its processes anyway, without its banner

# torchrun ends every failure with exit 1 and its own traceback (ChildFailedError and its report, or SignalException
# when it was signalled), after the ranks' one `error:` line; on a node whose rendezvous store (on the first node)
# went away first, it adds the store's C++ warnings and a RendezvousConnectionError. launch runs it with that face
# removed: the console keeps the ranks' output (a rank's own traceback included), torchrun's log lines, warnings and
# tracebacks (any torch.distributed exception raised through torch/distributed/run.py, with the causes chained before
# it) go to a file (shown only if no rank said why it failed), and run.sh exits with the ranks' code
# (docs/failures.md): each failing rank leaves it in RUN_SH_EXIT_DIR.
# torchrun runs in its own process group, so a Ctrl-C or SIGTERM reaches it once, from here; it passes the signal on
# to its processes, which stop after the step every rank agrees on, save (--save_checkpoint) and exit 130 or 143.
# A torchrun killed outright (SIGKILL, the OOM killer) leaves no one to pass a signal on: its workers then get SIGTERM
# from Linux (their parent-death signal) and stop the same way, and run.sh exits with their code.
# (mawk has no {n} intervals: hence the repeated [0-9].)
TORCHRUN_FACE='
  function aside(text) { print text > keep; fflush(keep) }
  function settle() {        # a held traceback, with the tracebacks chained before it, has ended
    if (last ~ /^torch\.distributed\.elastic\..*(ChildFailedError|SignalException)/ ||
        (last ~ /^torch\.distributed\./ && held ~ /torch\/distributed\/run\.py"/)) aside(held)
    else { print held; fflush() }
    state = last ~ /^torch\.distributed\.elastic\..*ChildFailedError/ ? 2 : 0
  }
  state == 3 {               # after an exception line: another traceback chained to it, or the end
    if ($0 == "" || $0 ~ /^(The above exception was the direct cause|During handling of the above exception)/) {
      held = held "\n" $0; next
    }
    if ($0 == "Traceback (most recent call last):") { held = held "\n" $0; state = 1; next }
    settle()
  }
  state == 4 {               # a c10d store warning: its C++ stack, up to a blank line
    if ($0 ~ /^(Exception raised from |frame #[0-9]+: |<omitting python frames>)/) { aside($0); next }
    state = 0; if ($0 == "") { aside($0); next }
  }
  state == 0 && /^\[[DIWEC][0-9][0-9][0-9][0-9] [0-9:.]+ [A-Za-z]+\.(cpp|hpp):[0-9]+\] \[c10d\]/ {
    aside($0); state = 4; next
  }
  state == 0 && /^[DIWEC][0-9][0-9][0-9][0-9] [0-9:.]+ +[0-9]+ .*torch\/distributed\// { aside($0); next }
  state == 0 && $0 == "Traceback (most recent call last):" { state = 1; held = $0; next }
  state == 1 {               # to the exception line: one not from torch.distributed shows at once
    held = held "\n" $0
    if ($0 !~ /^[ \t]/) { last = $0; if (last ~ /^torch\.distributed\./) state = 3; else { print held; fflush(); state = 0 } }
    next
  }
  state == 2 { aside($0); if ($0 ~ /^Root Cause/) root = 1; if (root && $0 ~ /^==+$/) state = root = 0; next }
  { print; fflush() }
  END { if (state == 3) settle(); else if (state == 1) print held }'
# The folder of the ranks' exit codes is a global: the EXIT trap may run after launch's locals are gone.
RUN_SH_STATUS=""
trap 'if [ -n "${RUN_SH_STATUS:-}" ]; then rm -rf "$RUN_SH_STATUS"; fi' EXIT
launch() {
  local status torchrun filter rc code c own="" sig="" peer="" signalled=""
  status=$(mktemp -d "${TMPDIR:-/tmp}/run_sh.XXXXXX")
  RUN_SH_STATUS=$status
  mkfifo "$status/stderr"
  (trap '' INT TERM HUP; exec awk -v keep="$status/torchrun.txt" "$TORCHRUN_FACE") < "$status/stderr" >&2 &
  filter=$!
  set -m
  RUN_SH_EXIT_DIR="$status" "$PY" -m torch.distributed.run "$@" 2> "$status/stderr" &
  torchrun=$!
  set +m
  for s in INT TERM HUP; do trap "signalled=\$(kill -l $s); kill -$s $torchrun 2>/dev/null || true" "$s"; done
  while :; do        # a trapped signal ends `wait` early: wait again until torchrun has ended
    if wait "$torchrun"; then rc=0; else rc=$?; fi
    kill -0 "$torchrun" 2>/dev/null || break
  done
  trap '' INT TERM HUP
  wait "$filter" || true
  [ "$rc" -eq 0 ] && exit 0
  for f in "$status"/rank*; do     # a rank's own failure (1, 2, 3, 5, 6), else a signal, else 4 (stopped by another)
    [ -e "$f" ] || continue
    c=$(cat "$f")
    case "$c" in 4) peer=4 ;; 1[2-9][0-9]|2[0-9][0-9]) sig=${sig:-$c} ;; *) own=${own:-$c} ;; esac
  done
  code=${own:-${sig:-$peer}}
  if [ -z "$code" ]; then          # no rank said why: show what torchrun said
    [ -n "$signalled" ] && code=$((128 + signalled)) || { cat "$status/torchrun.txt" >&2 2>/dev/null; code=$rc; }
  fi
  exit "$code"
}

if [ "$NNODES" -eq 1 ]; then
  launch --standalone --nproc_per_node="$NPROC" "$TRAIN" "$@"
fi
# A node that is still downloading has not started torchrun yet: the others wait for it in the rendezvous (its
# join_timeout, 600 s by default) and for the rendezvous store on MASTER_ADDR's node (read_timeout, 60 s by
# default), so both must outlast the slowest node's data step, or the nodes that were ready give up.
rdzv=(--nnodes="$NNODES" --nproc_per_node="$NPROC" --rdzv_backend=c10d
      --rdzv_endpoint="${MASTER_ADDR}:${MASTER_PORT:-29500}" --rdzv_id="${RDZV_ID:-nanogpt_speedrun}"
      --rdzv_conf="read_timeout=$RDZV_TIMEOUT,join_timeout=$RDZV_TIMEOUT")
# torchrun names this node to the others by its FQDN, which rented nodes often cannot resolve: LOCAL_ADDR replaces it.
if [ -n "${LOCAL_ADDR:-}" ]; then rdzv+=(--local_addr="$LOCAL_ADDR"); fi
echo "run.sh: node of $NNODES, $NPROC GPUs each ($((NNODES * NPROC)) processes); rendezvous at" \
     "${MASTER_ADDR}:${MASTER_PORT:-29500}${LOCAL_ADDR:+ as $LOCAL_ADDR}, waiting up to ${RDZV_TIMEOUT}s for every node"
launch "${rdzv[@]}" "$TRAIN" "$@"
