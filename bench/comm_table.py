"""What the optimizer's communication costs per step at 8, 16, 32 and 64 GPUs, against the step's compute: a
computed table (no GPU), from the model's own parameter sizes and the optimizer table's communication rows.

    python3 bench/comm_table.py [--link_gbps=400] [--nvlink_gbps=3600] [--gpus_per_node=8] [--step_ms_8=59.2]

Per optimizer step each rank reduce-scatters the gradient of every sharded row and all-gathers the updated slice
(NorMuon banks every step, Adam rows on odd steps only: half of it on average), and all-reduces the replicated rows.
A ring moves (W-1)/W of a tensor's bytes through every GPU's link for a reduce-scatter or an all-gather, and twice
that for an all-reduce. On one node that link is NVLink; across nodes each GPU's share of the inter-node link is
the bottleneck (NCCL's rings cross it), so the time is bytes / link speed, a lower bound that ignores latency and
assumes the node's GPUs use their links at once. The compute column scales the record's 8-GPU step time by 8/W (the
same global batch on W GPUs), which is optimistic past 8 (smaller matmuls run less efficiently). The step time of
record 61 is its published 104.5 s over 1765 steps on 8xH100.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def traffic_bytes(hp, world_size: int) -> dict[str, float]:
    """Average bytes through each GPU's link per optimizer step, by kind, for the default model at world_size."""
    import torch
    import train_gpt as tg
    model = tg.build_model(tg.slices_for(hp, world_size), torch.device("meta"), "sdpa")
    ring = (world_size - 1) / world_size
    per = {"banks (NorMuon, every step)": 0.0, "sharded Adam rows (odd steps)": 0.0, "replicated rows": 0.0}
    for label, p in model.named_parameters():
        row = hp.param_table[label]
        size = p.numel() * p.element_size()
        if label == "embed":       # tied to lm_head for the first 2/3 of training: reduced only after the untie
            size /= 3
        share = 1.0 if row["optim"] == "normuon" else 0.5      # Adam steps every other step
        if row["comms"] == "sharded":
            key = "banks (NorMuon, every step)" if row["optim"] == "normuon" else "sharded Adam rows (odd steps)"
            per[key] += 2 * ring * size * share                   # reduce-scatter + all-gather
        else:
            per["replicated rows"] += 2 * ring * size * share     # all-reduce
    return per


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--link_gbps", type=float, default=400.0, help="inter-node bandwidth per GPU, Gb/s")
    ap.add_argument("--nvlink_gbps", type=float, default=3600.0, help="NVLink bandwidth per GPU, Gb/s (H100: 900 GB/s)")
    ap.add_argument("--gpus_per_node", type=int, default=8)
    ap.add_argument("--step_ms_8", type=float, default=104.5e3 / 1765, help="mean step on 8 GPUs, ms")
    args = ap.parse_args()
    import train_gpt as tg
    hp = tg.Hyperparameters()
    print("| GPUs | nodes | bytes per GPU per step | link | comm ms (lower bound) | "
          f"compute ms (8/W of {args.step_ms_8:.1f}) | comm / compute |")
    print("|---|---|---|---|---|---|---|")
    for world in (8, 16, 32, 64):
        per = traffic_bytes(hp, world)
        total = sum(per.values())
        nodes = -(-world // args.gpus_per_node)
        gbps = args.nvlink_gbps if nodes == 1 else args.link_gbps
        comm_ms = total * 8 / (gbps * 1e9) * 1e3
        compute_ms = args.step_ms_8 * 8 / world
        print(f"| {world} | {nodes} | {total / 2**20:,.0f} MiB | {gbps:,.0f} Gb/s | {comm_ms:.1f} | {compute_ms:.1f} "
              f"| {comm_ms / compute_ms:.2f} |")
    print()
    for kind, b in traffic_bytes(hp, 16).items():
        print(f"at 16 GPUs, {kind}: {b / 2**20:,.0f} MiB per GPU per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
