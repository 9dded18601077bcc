"""What a training step costs at 8, 16, 32 and 64 GPUs: the optimizer's communication against each rank's compute, a
computed table (no GPU) from the model's own parameter sizes, the optimizer table, the schedule and measured
micro-batch times.

    python3 bench/comm_table.py [--times=bench/times_h200.json] [--gpus_per_node=8] [--nics_per_node=8]
        [--nic_gbps=400] [--nvlink_gbps=3600] [--hop_latency_us=9.6] [--nvlink_hop_latency_us=3.4]

Communication (NorMuonAndAdam.step). Each step, every rank reduce-scatters the gradient of each sharded row and
all-gathers its updated slice, and all-reduces each replicated row: the NorMuon banks every step, the Adam rows on odd
steps only (schedule_at's do_adam), and embed only after it unties from lm_head at the end of step hp.untie_step
(before, its gradient is folded into lm_head's and it is not reduced). The sizes are those of the model at
slices_for(hp, W), built on the meta device, so the banks carry the zero padding that lets them shard W ways.
A ring collective over W GPUs sends (W-1)/W of the tensor from every GPU (twice that for an all-reduce: a
reduce-scatter, then an all-gather) in W-1 steps (2(W-1)). The GPUs of a node sit next to one another on the ring, so
of a chunk's W-1 hops N-1 cross between the N nodes and the rest stay on NVLink (2(N-1) for an all-reduce: NCCL's
latency model, src/graph/tuning.cc). Of a ring's edges one per node leaves it, so a node's NICs together carry as many
bytes as each of its G GPUs sends (1/G of that per GPU: the NIC column). A collective takes
    hops x their latency + bytes / the slower of a GPU's NVLink and its node's NICs,
and the collectives run one after another on one stream, so their times add. The default latencies are NCCL's ring /
Simple-protocol figures per step (NVLink 3.4 us, network 9.6 us); NCCL runs small all-reduces with lower-latency
protocols or trees, so the latency of the small replicated rows is high here.

Compute (Trainer.train_step). Each rank runs batch_slices / W micro-batches per step (batch_slices as slices_for sets it
at W) of global batch / batch_slices tokens. A micro-batch takes max(gpu_ms, host_ms) from --times: a GPU cannot run a
kernel the host has not launched, so a compiled micro-batch takes at least the host's time to launch it (until CUDA
graphs replay it). Between measured sizes both times are linear in tokens; below the smallest, gpu_ms falls in
proportion to the tokens (optimistic: small matmuls run less efficiently) and host_ms stays the smallest size's (the
same kernels are launched); above the largest, gpu_ms grows in proportion and host_ms stays the largest size's.

The step. Serial, compute + communication, is this code's: opt.step launches every reduction after the last backward,
so the communication overlaps only the optimizer's own update work, which this table leaves out (about 2.2 ms of an
8-GPU rank's step, notes/2026-11-27_rank8_host_power_H200/). Overlapped, max(compute, communication), is the bound
for a trainer that reduced under the backward. Every column is a mean over the schedule's steps (each with its own
batch size, Adam parity and tie state). "limited by" is the largest term of the serial step: compute (micro-batches the
GPU bounds), host floor (those the host bounds), bandwidth or latency. Not counted: data loading, NCCL's fixed cost
per collective (~8 us), and the ranks' skew (they reach the first reduction 0.1-4.4 ms apart on 4x H200).
--times is a JSON file {"<tokens per micro-batch>": {"gpu_ms": x, "host_ms": y}, ..., "source": "..."}, as
bench/model_step.py --host --json=PATH writes it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TIMES = ROOT / "bench" / "times_h200.json"
WORLD_SIZES = (8, 16, 32, 64)
MiB = 2 ** 20


# ---- the network and one ring collective ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Network:
    gpus_per_node: int = 8                 # G: GPUs per node, consecutive on the ring
    nics_per_node: int = 8                 # NICs per node, shared by the node's ring edges that leave it
    nic_gbps: float = 400.0                # each NIC, Gb/s each way
    nvlink_gbps: float = 3600.0            # each GPU's NVLink, Gb/s each way (H100 / H200: 450 GB/s)
    hop_latency_us: float = 9.6            # one ring step between nodes (NCCL: ring, Simple protocol)
    nvlink_hop_latency_us: float = 3.4     # one ring step on NVLink (the same table)


def num_nodes(world: int, gpus_per_node: int) -> int:
    return -(-world // gpus_per_node)


def ring_bytes(kind: str, size: float, world: int) -> float:
    """Bytes each GPU sends in a ring collective over `world` GPUs of a tensor of `size` bytes."""
    share = (world - 1) / world * size
    return 2 * share if kind == "all_reduce" else share


def ring_hops(kind: str, world: int, gpus_per_node: int) -> tuple[int, int]:
    """(hops, of which between nodes) that a ring collective's last chunk makes one after another."""
    inter = num_nodes(world, gpus_per_node) - 1
    hops = world - 1
    return (2 * hops, 2 * inter) if kind == "all_reduce" else (hops, inter)


def nic_bytes_per_gpu(kind: str, size: float, world: int, gpus_per_node: int) -> float:
    """Bytes through the NICs per GPU: one ring edge in gpus_per_node leaves a node, none on one node."""
    if num_nodes(world, gpus_per_node) == 1:
        return 0.0
    return ring_bytes(kind, size, world) / gpus_per_node


def collective_ms(kind: str, size: float, world: int, net: Network) -> tuple[float, float]:
    """(bandwidth ms, latency ms) of one ring collective of a `size`-byte tensor over `world` GPUs."""
    sent = ring_bytes(kind, size, world)
    ms = sent * 8 / (net.nvlink_gbps * 1e9) * 1e3
    if num_nodes(world, net.gpus_per_node) > 1:         # the node's NICs carry what each GPU sends
        ms = max(ms, sent * 8 / (net.nics_per_node * net.nic_gbps * 1e9) * 1e3)
    hops, inter = ring_hops(kind, world, net.gpus_per_node)
    latency_ms = (inter * net.hop_latency_us + (hops - inter) * net.nvlink_hop_latency_us) / 1e3
    return ms, latency_ms


# ---- what a step communicates (the optimizer table) --------------------------------------------------------------

def due_labels(table: dict[str, dict], do_adam: bool, tied_now: bool,
               tied: tuple[str, str] = ("lm_head", "embed")) -> list[str]:
    """The labels NorMuonAndAdam.step reduces, in its launch order: NorMuon rows every step, Adam rows when do_adam,
    and the tied embedding (tied[1]) not while tied."""
    return [label for label, row in table.items()
            if (do_adam or row["optim"] == "normuon") and not (tied_now and label == tied[1])]


def step_collectives(labels: list[str], table: dict[str, dict],
                     sizes: dict[str, int]) -> list[tuple[str, str, int]]:
    """(label, collective, bytes of the whole tensor) per collective: sharded rows reduce-scatter and all-gather,
    replicated rows all-reduce, rows with comms 'none' send nothing."""
    kinds = {"sharded": ("reduce_scatter", "all_gather"), "replicated": ("all_reduce",), "none": ()}
    return [(label, kind, sizes[label]) for label in labels for kind in kinds[table[label]["comms"]]]


def schedule_counts(hp) -> Counter:
    """Steps of the whole schedule by (global batch, do_adam, tied_now); embed and lm_head are tied through step
    hp.untie_step (Trainer.train_step unties them after it)."""
    import train_gpt as tg
    return Counter((s.global_batch, s.do_adam, s.step <= hp.untie_step)
                   for s in (tg.schedule_at(step, hp) for step in range(hp.num_iterations)))


# ---- compute from measured micro-batches --------------------------------------------------------------------------

def load_times(path: str | Path) -> tuple[dict[int, tuple[float, float]], str]:
    """({tokens: (gpu_ms, host_ms)}, device) of a times file; ValueError naming what is wrong."""
    data = json.loads(Path(path).read_text())
    times = {}
    for key, value in data.items():
        if not key.isdigit():
            continue
        if not (isinstance(value, dict) and {"gpu_ms", "host_ms"} <= set(value)):
            raise ValueError(f"{path}: entry {key!r} needs gpu_ms and host_ms (bench/model_step.py --host --json)")
        times[int(key)] = (float(value["gpu_ms"]), float(value["host_ms"]))
    if not times:
        raise ValueError(f"{path}: no measured sizes: give {{\"<tokens>\": {{\"gpu_ms\": x, \"host_ms\": y}}}}")
    return times, str(data.get("device", "device not named"))


def micro_batch_ms(times: dict[int, tuple[float, float]], tokens: int) -> tuple[float, float]:
    """(gpu_ms, host_ms) of one micro-batch of `tokens`: linear between measured sizes; outside them gpu_ms in
    proportion to the tokens from the nearest measured size and host_ms that size's."""
    sizes = sorted(times)
    if not sizes[0] < tokens < sizes[-1]:
        edge = sizes[0] if tokens <= sizes[0] else sizes[-1]
        gpu, host = times[edge]
        return gpu * tokens / edge, host
    hi = next(size for size in sizes if size >= tokens)
    lo = sizes[sizes.index(hi) - 1]
    t = (tokens - lo) / (hi - lo)
    (gpu_lo, host_lo), (gpu_hi, host_hi) = times[lo], times[hi]
    return gpu_lo + (gpu_hi - gpu_lo) * t, host_lo + (host_hi - host_lo) * t


# ---- one world size ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Cost:
    """Means over the schedule's steps at one world size (ms, bytes)."""
    world: int
    nodes: int
    nic_bytes: float          # through the NICs, per GPU per step
    padding_bytes: float      # the banks' zero padding past the 8-GPU sizes
    bandwidth_ms: float
    latency_ms: float
    compute_ms: float         # micro-batches, each max(gpu_ms, host_ms)
    host_bound_ms: float      # the part of compute_ms in micro-batches the host bounds
    nohost_compute_ms: float  # micro-batches at gpu_ms alone (the host floor gone, e.g. CUDA graphs)
    overlapped_ms: float      # max(compute, comm) per step
    micro_batches: int        # per rank per step
    stages: tuple             # (tokens per micro-batch, gpu_ms, host_ms) per global batch, smallest first

    @property
    def comm_ms(self) -> float:
        return self.bandwidth_ms + self.latency_ms

    @property
    def serial_ms(self) -> float:
        return self.compute_ms + self.comm_ms

    @property
    def nohost_serial_ms(self) -> float:
        return self.nohost_compute_ms + self.comm_ms

    @property
    def limit(self) -> str:
        terms = {"compute": self.compute_ms - self.host_bound_ms, "host floor": self.host_bound_ms,
                 "bandwidth": self.bandwidth_ms, "latency": self.latency_ms}
        return max(terms, key=terms.get)


def world_cost(world: int, sizes: dict[str, int], base_sizes: dict[str, int], table: dict[str, dict],
               counts: Counter, batch_slices: int, times: dict[int, tuple[float, float]], net: Network) -> Cost:
    """The step at `world` GPUs: sizes are the model's parameter bytes there (base_sizes at 8 GPUs), counts the
    schedule's steps by (global batch, do_adam, tied_now), batch_slices as slices_for sets it at `world`."""
    micro_batches = batch_slices // world                                 # Trainer.grad_accum
    total = dict(nic=0.0, bw=0.0, lat=0.0, compute=0.0, host=0.0, nohost=0.0, overlapped=0.0)
    stages = {}
    for (global_batch, do_adam, tied_now), n in counts.items():
        tokens = global_batch // batch_slices                             # train_gpt.micro_batch_tokens
        gpu, host = micro_batch_ms(times, tokens)
        stages[global_batch] = (tokens, gpu, host)
        compute = micro_batches * max(gpu, host)
        bw = lat = nic = 0.0
        for _, kind, size in step_collectives(due_labels(table, do_adam, tied_now), table, sizes):
            b, lt = collective_ms(kind, size, world, net)
            bw, lat, nic = bw + b, lat + lt, nic + nic_bytes_per_gpu(kind, size, world, net.gpus_per_node)
        for key, value in (("nic", nic), ("bw", bw), ("lat", lat), ("compute", compute),
                           ("host", compute if host > gpu else 0.0), ("nohost", micro_batches * gpu),
                           ("overlapped", max(compute, bw + lat))):
            total[key] += n * value
    steps = sum(counts.values())
    mean = {key: value / steps for key, value in total.items()}
    return Cost(world=world, nodes=num_nodes(world, net.gpus_per_node), nic_bytes=mean["nic"],
                padding_bytes=sum(sizes.values()) - sum(base_sizes.values()), bandwidth_ms=mean["bw"],
                latency_ms=mean["lat"], compute_ms=mean["compute"], host_bound_ms=mean["host"],
                nohost_compute_ms=mean["nohost"], overlapped_ms=mean["overlapped"], micro_batches=micro_batches,
                stages=tuple(stages[b] for b in sorted(stages)))


def param_bytes(hp, world: int) -> dict[str, int]:
    """Bytes of each parameter of the model as `world` GPUs build it (slices_for: padded banks), on meta."""
    import torch
    import train_gpt as tg
    model = tg.build_model(tg.slices_for(hp, world), torch.device("meta"), "sdpa")
    return {label: p.numel() * p.element_size() for label, p in model.named_parameters()}


def costs(hp, times: dict[int, tuple[float, float]], net: Network, worlds=WORLD_SIZES) -> list[Cost]:
    import train_gpt as tg
    counts = schedule_counts(hp)
    base = param_bytes(hp, worlds[0])
    return [world_cost(w, param_bytes(hp, w), base, hp.param_table, counts, tg.slices_for(hp, w).batch_slices,
                       times, net) for w in worlds]


# ---- the table ----------------------------------------------------------------------------------------------------

def table_lines(rows: list[Cost]) -> list[str]:
    """The two markdown tables docs/multi-node.md shows: the step, then its micro-batches. Ranges run low - high."""
    base = rows[0]
    lines = ["| GPUs | nodes | NIC MiB per GPU per step | banks' padding MiB | comm ms: bandwidth + latency "
             "| compute ms | step ms: overlapped - serial | speed-up vs 8: serial - overlapped | limited by "
             "| without the host floor: serial ms, speed-up |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        nic = f"{r.nic_bytes / MiB:,.0f}" if r.nodes > 1 else "0 (NVLink)"
        lines.append(f"| {r.world} | {r.nodes} | {nic} | {r.padding_bytes / MiB:,.0f} "
                     f"| {r.comm_ms:.1f} = {r.bandwidth_ms:.1f} + {r.latency_ms:.1f} | {r.compute_ms:.1f} "
                     f"| {r.overlapped_ms:.1f} - {r.serial_ms:.1f} "
                     f"| {base.serial_ms / r.serial_ms:.2f}x - {base.overlapped_ms / r.overlapped_ms:.2f}x "
                     f"| {r.limit} | {r.nohost_serial_ms:.1f}, {base.nohost_serial_ms / r.nohost_serial_ms:.2f}x |")
    lines += ["", "| GPUs | micro-batches per rank per step | tokens per micro-batch, by stage "
              "| ms per micro-batch, by stage: GPU (host) |", "|---|---|---|---|"]
    for r in rows:
        tokens = " / ".join(f"{t:,}" for t, _, _ in r.stages)
        ms = " / ".join(f"{g:.1f} ({h:.1f}{'*' if h > g else ''})" for _, g, h in r.stages)
        lines.append(f"| {r.world} | {r.micro_batches} | {tokens} | {ms} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = Network()
    for f in dataclasses.fields(Network):
        default = getattr(defaults, f.name)
        ap.add_argument(f"--{f.name}", type=type(default), default=default)
    ap.add_argument("--times", default=str(DEFAULT_TIMES.relative_to(ROOT)),
                    help="micro-batch times, JSON (relative paths from the repository root)")
    args = ap.parse_args(argv)
    net = Network(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Network)})
    bad = [f"--{f.name}={getattr(net, f.name)}" for f in dataclasses.fields(Network) if getattr(net, f.name) <= 0]
    if bad:
        print(f"error: {', '.join(bad)}: give a positive number", file=sys.stderr)
        return 2
    uneven = [w for w in WORLD_SIZES if w > net.gpus_per_node and w % net.gpus_per_node]
    if uneven:
        print(f"error: --gpus_per_node={net.gpus_per_node} does not divide {uneven} GPUs into whole nodes",
              file=sys.stderr)
        return 2
    path = Path(args.times) if Path(args.times).is_absolute() else ROOT / args.times
    try:
        times, device = load_times(path)
    except (OSError, ValueError) as e:
        print(f"error: --times: {e}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))
    import train_gpt as tg
    print("\n".join(table_lines(costs(tg.Hyperparameters(), times, net))))
    print(f"\n`*`: the host bounds this micro-batch. Micro-batch times: `{args.times}` ({device}).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
