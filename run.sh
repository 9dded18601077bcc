#!/usr/bin/env bash
# Train the record model on this node's GPUs:  ./run.sh [--name=value ...]   (options: see Hyperparameters in train_gpt.py)
# NPROC=4 ./run.sh uses 4 GPUs; the math is the same on 1, 2, 4 or 8 (gradient accumulation keeps the global batch).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

if ! "$PY" -c "import torch, triton, numpy, tiktoken, huggingface_hub" 2>/dev/null; then
  echo "run.sh: installing requirements ($PY -m pip install -r requirements.txt)"
  "$PY" -m pip install -q -r requirements.txt
fi

NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
if [ "$NGPU" -eq 0 ]; then
  echo "run.sh: error: no CUDA GPU found (check nvidia-smi and CUDA_VISIBLE_DEVICES)." >&2
  echo "  To try the trainer on a CPU: python3 train_gpt.py --preset=tiny --train_files=... --val_files=... (see README)" >&2
  exit 1
fi
if [ -n "${NPROC:-}" ]; then
  case "$NPROC" in 1|2|4|8) ;; *) echo "run.sh: error: NPROC=$NPROC must divide 8 (1, 2, 4 or 8)" >&2; exit 1;; esac
  if [ "$NPROC" -gt "$NGPU" ]; then echo "run.sh: error: NPROC=$NPROC but only $NGPU GPU(s) found" >&2; exit 1; fi
else
  for n in 8 4 2 1; do if [ "$NGPU" -ge "$n" ]; then NPROC=$n; break; fi; done
  if [ "$NPROC" -ne "$NGPU" ]; then
    echo "run.sh: $NGPU GPUs found; using $NPROC (the GPU count must divide 8). Set NPROC to choose."
  fi
fi

# Data: the default globs point at data/fineweb10B; other data is passed with --train_files / --val_files.
if ! printf '%s\n' "$@" | grep -q -- '^--train_files=' && ! ls data/fineweb10B/fineweb_train_*.bin >/dev/null 2>&1; then
  echo "run.sh: error: no training data in data/fineweb10B/." >&2
  echo "  Download it (about 2 GB):   $PY data/cached_fineweb10B.py" >&2
  syn=data/synthetic
  echo "  Or smoke-test with synthetic data: $PY data/synthetic.py --out $syn --preset=full" >&2
  echo "      ./run.sh --train_files='$syn/fineweb_train_*.bin' --val_files='$syn/fineweb_val_*.bin'" >&2
  exit 1
fi

export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True}
exec "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" train_gpt.py "$@"
