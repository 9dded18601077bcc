"""Time one NorMuonAndAdam step at the record's shapes: exposed communication = total - compute.

    torchrun --standalone --nproc_per_node=1 bench/optimizer.py
    torchrun --standalone --nproc_per_node=4 bench/optimizer.py [--iters=20]

Builds the trainer's model on CUDA (its 13 labelled parameters) with random gradients and times, with CUDA events,
(a) an Adam step while embed and lm_head are tied, (b) the same after untie(), (c) a NorMuon-only step. "compute"
runs the same step with the communication removed (each rank updates its own shard and launches no collective), so
total - compute is the communication the step fails to hide. Prints one table on rank 0 (each number: the max over
ranks of the median).
"""
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt as tg  # noqa: E402


class ComputeOnly(tg.NorMuonAndAdam):
    """The same step with no collectives: the 'reduced' gradient is this rank's slice of its own gradient."""

    def _launch_reduce(self, label, grad):
        return None, self._local(label, grad)

    def _launch_gather(self, label):
        return None


def time_steps(opt, params, grads, do_adam: bool, warmup: int, iters: int) -> float:
    times = []
    for i in range(warmup + iters):
        for k, p in params.items():
            p.grad = grads[k].clone()
        torch.cuda.synchronize()
        if dist.is_initialized():
            dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        opt.step(do_adam=do_adam, lr_factor=1.0, momentum=0.95)
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    iters = 20
    for arg in sys.argv[1:]:
        if arg.startswith("--iters="):
            iters = int(arg.split("=", 1)[1])
        else:
            raise SystemExit(f"unknown argument {arg!r}; usage: bench/optimizer.py [--iters=N]")
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    if world_size > 1:
        dist.init_process_group("nccl", device_id=device)
    hp = tg.Hyperparameters()
    torch.manual_seed(1234)
    model = tg.build_model(hp, device, "sdpa")             # the record's parameters, as the trainer builds them
    params = dict(model.named_parameters())
    torch.manual_seed(1234 + rank)
    grads = {k: torch.randn_like(p) * 1e-3 for k, p in params.items()}
    kwargs = dict(adam_lr=hp.adam_lr, adam_eps=hp.adam_eps, adam_wd=hp.adam_wd, muon_lr=hp.muon_lr,
                  muon_beta2=hp.muon_beta2, muon_wd=hp.muon_wd, rank=rank, world_size=world_size)
    full = tg.build_optimizer(hp, model, rank, world_size)
    compute = ComputeOnly(params, full.table, **kwargs)
    rows = []
    for case in ("adam step, tied", "adam step, untied", "normuon-only step"):
        if case == "adam step, untied":
            full.untie()
            compute._tied_now = False           # its state is not compared, only timed
        do_adam = case.startswith("adam")
        t_total = time_steps(full, params, grads, do_adam, warmup=3, iters=iters)
        t_compute = time_steps(compute, params, grads, do_adam, warmup=3, iters=iters)
        rows.append([case, t_total, t_compute])
    result = torch.tensor([[r[1], r[2]] for r in rows], device=device)
    if world_size > 1:
        dist.all_reduce(result, op=dist.ReduceOp.MAX)
    if rank == 0:
        name = torch.cuda.get_device_name(device)
        print(f"NorMuonAndAdam step, {world_size} x {name}, torch {torch.__version__}, "
              f"median of {iters} (max over ranks)")
        print(f"{'case':<20} {'total ms':>10} {'compute ms':>11} {'exposed comm ms':>16}")
        for (case, _, _), (total, comp) in zip(rows, result.tolist()):
            print(f"{case:<20} {total:>10.3f} {comp:>11.3f} {total - comp:>16.3f}")
    if world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
