"""bench/key_offset.py's variants: the shift after the op and the shift inside it must be the same math (on the CPU
both run the plain-PyTorch definitions), and the unshifted variant must differ from them in k only; otherwise the
bench would time different math."""
import sys

import torch

from _shards import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import key_offset  # noqa: E402


def test_variants_shift_k_only_and_agree_forward_and_backward():
    T, H, hd = 13, 2, 16
    g = torch.Generator().manual_seed(5)
    tg = key_offset.tg
    cos, sin = tg.rotary_tables(tg.rotary_base_omega(hd, 1024.0, torch.device("cpu")), T, torch.float32)
    qkv = torch.randn(T, 3 * H * hd, generator=g).requires_grad_()
    grads = [torch.randn(T, H, hd, generator=g) for _ in range(3)]
    outs = {}
    for name in ("no shift", "compiled shift after", "shift in the kernels"):
        q, k, v = key_offset.variant(name)(qkv, cos, sin)
        outs[name] = (q, k, *torch.autograd.grad((q, k, v), qkv, grads))
    for a, b in zip(outs["compiled shift after"], outs["shift in the kernels"]):
        assert torch.equal(a, b)
    plain, shifted = outs["no shift"], outs["shift in the kernels"]
    assert torch.equal(plain[0], shifted[0]) and torch.equal(plain[1][0], shifted[1][0])
    assert not torch.equal(plain[1][1:], shifted[1][1:]) and not torch.equal(plain[2], shifted[2])
