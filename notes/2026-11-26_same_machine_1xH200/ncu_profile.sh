#!/bin/bash
# Nsight Compute counters of the shipped MLP forward kernel and three Gluon forwards (mlp_gluon.py --ncu-target):
# 128x256x32 with 4 stages, 128x256x64 with 2 stages, and the latter without its epilogue. Each is launched twice;
# all eight launches are profiled. On the device:
#     bash notes/2026-11-26_same_machine_1xH200/ncu_profile.sh
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
[ -x "$NCU" ] || { echo "error: Nsight Compute (ncu) not found; run this on the device"; exit 1; }
HERE=$(dirname "$0")
STALL=smsp__average_warps_issue_stalled
M=gpu__time_duration.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
M=$M,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.per_cycle_active,lts__t_bytes.sum
M=$M,dram__bytes_read.sum,dram__bytes_write.sum,smsp__inst_executed.sum
for r in barrier long_scoreboard short_scoreboard wait math_pipe_throttle mio_throttle not_selected dispatch_stall \
         membar sleeping lg_throttle; do
    M=$M,${STALL}_${r}_per_issue_active.ratio
done
"$NCU" -k regex:'_relu2_linear' --metrics "$M" python3 "$HERE/mlp_gluon.py" --ncu-target 2>&1 \
    | grep -E "^\s+(smsp|sm__|gpu__|lts|dram)|_kernel|error"
