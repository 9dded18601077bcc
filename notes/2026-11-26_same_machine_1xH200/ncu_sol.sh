#!/bin/bash
# Nsight Compute's speed-of-light section (throughput of each unit as a share of its peak) for cuBLAS's x @ w.T, the
# shipped MLP forward and the Gluon forwards at 49k rows (mlp_gluon.py --ncu-target; the second launch of each kind).
# On the device:
#     bash notes/2026-11-26_same_machine_1xH200/ncu_sol.sh
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
[ -x "$NCU" ] || { echo "error: Nsight Compute (ncu) not found; run this on the device"; exit 1; }
HERE=$(dirname "$0")
M=lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_write.sum,lts__t_sector_hit_rate.pct
"$NCU" -k regex:'_relu2_linear|nvjet|gemm|cutlass' --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --metrics "$M" python3 "$HERE/mlp_gluon.py" --ncu-target 2>&1 \
    | grep -vE "^\s*$|----|WRN|OPT|INF" | grep -vE "==PROF==" 
