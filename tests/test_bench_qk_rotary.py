"""bench/qk_rotary.py's formulations of the rotary: each must be the flip formulation (the trainer's former one) bit
for bit (eager, on the CPU), in bf16 and float32, for the normal and the paired layout, forward and backward; otherwise
its timings would compare different math."""
import sys

import pytest
import torch

from _shards import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import qk_rotary  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("paired", [False, True])
@pytest.mark.parametrize("name", [n for n in qk_rotary.FORMULATIONS if n != "flip (trainer)"])
def test_formulations_are_the_trainers_rotary_bit_for_bit(name, paired, dtype):
    T, H, hd = 37, 4, 16
    g = torch.Generator().manual_seed(3)
    omega = qk_rotary.tg.rotary_base_omega(hd, 1024.0, torch.device("cpu"))
    cos, sin = qk_rotary.tg.rotary_tables(omega, 2 * T, dtype)
    qkv = torch.randn(T, 3 * H * hd, generator=g).to(dtype).requires_grad_()
    grads = [torch.randn(T, H, hd, generator=g).to(dtype) for _ in range(2)]
    outs = []
    for fn in (qk_rotary.FORMULATIONS["flip (trainer)"], qk_rotary.FORMULATIONS[name]):
        q, k = qk_rotary.block(fn, paired, H, hd)(qkv, cos, sin)
        outs.append((q, k, *torch.autograd.grad((q, k), qkv, grads)))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    # the rotation moved something: a formulation that dropped the swapped term would not match the trainer's
    q_plain = qk_rotary.tg.rms(qkv.detach().view(T, 3, H, hd)[:, 0])
    assert not torch.equal(outs[0][0], q_plain)
