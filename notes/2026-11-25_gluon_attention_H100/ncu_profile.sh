#!/bin/bash
# Nsight Compute counters of the shipped Triton attention kernels and their Gluon variants at one training shape
# (default 49k tokens, window 1408): the second launch of each (the target makes 8 matching launches first: the
# forward that gives out and lse, then one round of the seven kernels, which compiles them). On the device:
#     bash notes/2026-11-25_gluon_attention_H100/ncu_profile.sh [T:layout:window]
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
[ -x "$NCU" ] || { echo "error: Nsight Compute (ncu) not found; run this on the device"; exit 1; }
HERE=$(dirname "$0")
STALL=smsp__average_warps_issue_stalled
M=gpu__time_duration.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
M=$M,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.per_cycle_active,lts__t_bytes.sum
M=$M,smsp__inst_executed.sum,smsp__inst_executed_pipe_fma.sum,smsp__inst_executed_pipe_alu.sum
M=$M,smsp__inst_executed_pipe_xu.sum,smsp__inst_executed_pipe_lsu.sum
for r in barrier long_scoreboard short_scoreboard wait math_pipe_throttle mio_throttle not_selected dispatch_stall; do
    M=$M,${STALL}_${r}_per_issue_active.ratio
done
"$NCU" -k regex:'(_attn_(fwd|dq|dkdv)|_ws2?_fwd)_kernel' --launch-skip 8 --launch-count 7 --metrics "$M" \
    python3 "$HERE/attention_gluon.py" "${1:-49152:normal:1408}" --ncu-target 2>&1 \
    | grep -E "^\s+(smsp|sm__|gpu__|lts)|_kernel \(|error"
