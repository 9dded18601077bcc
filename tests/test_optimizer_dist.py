"""NorMuonAndAdam over gloo with 2 and 4 processes: the sharded and replicated paths must give exactly the world-1
result on the averaged gradients, for every parameter and every state buffer."""
import datetime
import os
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from test_optimizer import make_grads, make_opt, make_params

# (gradient seed, do_adam) per step, then untie, then more steps: a NorMuon-only step, an Adam step while tied
# (fold + copy), the split, and both kinds of step untied.
TIED_STEPS = [(100, False), (101, True)]
UNTIED_STEPS = [(102, False), (103, True)]


def rank_grads(params, seed, rank, world_size):
    """Per-rank gradients whose average is exactly make_grads(params, seed): g + d_r with sum_r d_r = 0, all on the
    1/256 grid and small, so every bf16 sum in any order, the tied fold and the power-of-two average are exact."""
    avg = make_grads(params, seed)
    deltas = [make_grads(params, seed * 1000 + r) for r in range(world_size - 1)]
    if rank < world_size - 1:
        mine = deltas[rank]
    else:
        mine = {k: -sum(d[k] for d in deltas) if world_size > 1 else torch.zeros_like(avg[k]) for k in avg}
    return avg, {k: avg[k] + mine[k] for k in avg}


def add_grads(params, grads):
    for k, p in params.items():
        p.grad = grads[k].clone() if p.grad is None else p.grad + grads[k]


def check_equal(tag, params, ref_params, opt, ref_opt, rank, world_size):
    for k in params:
        assert torch.equal(params[k].detach(), ref_params[k].detach()), f"{tag}: parameter {k} differs"
        g, rg = params[k].grad, ref_params[k].grad
        assert (g is None) == (rg is None), f"{tag}: {k}.grad kept on one side only"
    assert opt.adam_t == ref_opt.adam_t and opt.tied_now == ref_opt.tied_now, tag
    for label, buf in opt.buffers.items():
        for name, t in buf.items():
            full = ref_opt.buffers[label][name]
            if opt.table[label]["comms"] == "sharded":
                c = full.shape[0] // world_size
                full = full[rank * c:(rank + 1) * c]
            assert torch.equal(t, full), f"{tag}: state {label}.{name} differs on rank {rank}"


def worker(rank, world_size, init_file, err_dir):
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=60))
        torch.set_num_threads(1)
        params, ref_params = make_params(7), make_params(7)
        opt = make_opt(params, world_size=world_size, rank=rank)
        ref_opt = make_opt(ref_params, world_size=1, rank=0)       # no communication at world size 1
        for phase, steps in (("tied", TIED_STEPS), ("untied", UNTIED_STEPS)):
            for seed, do_adam in steps:
                avg, mine = rank_grads(params, seed, rank, world_size)
                add_grads(params, mine)
                add_grads(ref_params, avg)
                # On even steps the Adam grads are kept; the distributed side holds this rank's own (un-averaged)
                # sums then, so compare grads only by presence.
                opt.step(do_adam=do_adam, lr_factor=1.2, momentum=0.88)
                ref_opt.step(do_adam=do_adam, lr_factor=1.2, momentum=0.88)
                check_equal(f"{phase} step seed={seed} do_adam={do_adam}", params, ref_params, opt, ref_opt, rank,
                            world_size)
            if phase == "tied":
                opt.untie()
                ref_opt.untie()
                check_equal("after untie", params, ref_params, opt, ref_opt, rank, world_size)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(err_dir, f"rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world_size", [2, 4])
def test_sharded_and_replicated_paths_match_world_size_one(world_size):
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "pg_init")
        ctx = mp.start_processes(worker, args=(world_size, init_file, tmp), nprocs=world_size, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + 150
        try:
            finished = False        # join() returns False whenever one process exits while others still run
            while not finished and time.monotonic() < deadline:
                finished = ctx.join(timeout=max(1.0, deadline - time.monotonic()))
        except Exception:
            errors = [open(os.path.join(tmp, f)).read() for f in sorted(os.listdir(tmp)) if f.startswith("rank")]
            pytest.fail("\n".join(errors) or "a worker failed")
        if not finished:
            for proc in ctx.processes:          # only the processes this test started
                proc.kill()
            pytest.fail(f"world_size {world_size}: workers did not finish within 150 s (a collective hung?)")
