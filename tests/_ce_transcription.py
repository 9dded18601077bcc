"""Float64 transcription of record 80's training loss and its FP8 logit gradient (the softcapped multi-token cross
entropy, its gradient formed in the forward and quantised to e5m2), written from the record's math with loops and
nothing from triton_kernels.py, for the tests of the kernels (tests/_kernels_interp.py), the references
(tests/test_kernels.py) and the model's head (tests/test_model.py).

Rounding points that are the record's math are transcribed exactly: sigma rounded to bf16, the fp32 products of the
gradient factor left to right, e5m2 by round-to-nearest-even straight from fp32 with saturation to +-57344. What the
record computes approximately (tanh/exp/log) is float64 here; `ambiguous` marks the values that sit so close to a
rounding boundary that an fp32 implementation may legally land on either side.
"""
import struct

import torch

A, B, C = 23.0, 5.0, 7.5
E5M2_MAX = 57344.0


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


INV_C = f32(1 / C)                  # 0x3E088889
B_DIV_C = f32(B * INV_C)            # 0x3F2AAAAB
INV_C_A = f32(INV_C * A)            # 0x40444445


def round_f32(x: torch.Tensor) -> torch.Tensor:
    return x.double().float().double()


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """float64 -> bf16 (nearest even) as float64; via fp32, a double rounding only at exact fp32 ties, which the
    inputs here never hit."""
    return x.double().float().bfloat16().double()


def round_e5m2(x: torch.Tensor) -> torch.Tensor:
    """float64 -> e5m2 by round-to-nearest-even, saturating at +-57344, NaN stays NaN: quantum 2^(e-2) for
    2^e <= |x| (normal, e >= -14), 2^-16 below (subnormal)."""
    x = x.double()
    _, e = torch.frexp(x)                                   # |x| = m 2^e, m in [0.5, 1)
    quantum = torch.exp2((e - 3).clamp_min(-16).double())
    q = torch.round(x / quantum) * quantum                   # torch.round: half to even
    return torch.where(torch.isnan(x), x, q.clamp(-E5M2_MAX, E5M2_MAX))


def ambiguous(x: torch.Tensor, rounding, rel: float) -> torch.Tensor:
    """Where rounding(x) would change if x moved by a relative `rel` (x sits next to a rounding boundary)."""
    x = x.double()
    return (rounding(x * (1 + rel)) != rounding(x)) | (rounding(x * (1 - rel)) != rounding(x))


def sigma64(logits: torch.Tensor) -> torch.Tensor:
    """sigma(l (1/C) + B/C), float64 (the record's fma, with fp32 constants)."""
    return torch.sigmoid(logits.double() * INV_C + B_DIV_C)


def logits_clear_of_bf16_ties(n: int, V: int, g: torch.Generator, scale: float, dtype=torch.float32,
                              rel: float = 3e-5) -> torch.Tensor:
    """Random logits (n, V) in dtype whose sigma is not within `rel` of a bf16 rounding boundary (redrawn where it
    is), so that an fp32 sigma rounds to the same bf16 value as the float64 one."""
    logits = (torch.randn(n, V, generator=g) * scale).to(dtype)
    for _ in range(100):
        bad = ambiguous(sigma64(logits), round_bf16, rel)
        if not bad.any():
            return logits
        logits[bad] = (torch.randn(int(bad.sum()), generator=g) * scale).to(dtype)
    raise AssertionError("could not draw logits clear of bf16 ties")


def ce_train(logits: torch.Tensor, targets: torch.Tensor, weights, rounded: bool = True, prefix=None,
             w_p: float = 0.0) -> dict:
    """Per row r: s = bf16(sigma) (rounded) or sigma, lse = log sum_c e^(A s_c), loss_r = sum_k [r+k < n]
    [0 <= y < V] w_k (lse - A s_y) (no w_k > 0 test), S_w = sum of ALL weights (tail rule), T_c = sum of w_k over
    the offsets with r+k < n and y_{r+k} = c, delta = S_w p - T_c, p = e^(A s - lse). All float64.
    prefix (n,) ids (-1: none), the prefix-token term of record 88: where tau_r = prefix[r] is in [0, V), loss_r
    gains w_p (lse - A s_tau), S_w gains w_p and T_tau gains w_p."""
    n, V = logits.shape
    sig = sigma64(logits)
    s = round_bf16(sig) if rounded else sig
    z = A * s
    lse = torch.logsumexp(z, dim=1)
    w = [float(x) for x in weights]
    losses = torch.zeros(n, dtype=torch.float64)
    t_c = torch.zeros(n, V, dtype=torch.float64)
    for r in range(n):
        for k, wk in enumerate(w):
            if r + k < n and 0 <= int(targets[r + k]) < V:
                y = int(targets[r + k])
                losses[r] += wk * (lse[r] - z[r, y])
                t_c[r, y] += wk
    s_w = torch.full((n, 1), sum(w), dtype=torch.float64)
    for r in range(n if prefix is not None else 0):
        tau = int(prefix[r])
        if 0 <= tau < V:
            losses[r] += w_p * (lse[r] - z[r, tau])
            t_c[r, tau] += w_p
            s_w[r] += w_p
    delta = s_w * torch.exp(z - lse[:, None]) - t_c
    return dict(s=s, sigma=sig, lse=lse, losses=losses, delta=delta, s_w=s_w, t_c=t_c)


def fp8_grad_factor(grad_scale: float, s_g: float) -> float:
    """((grad_scale (1/C A)) (1/s_g)), each product rounded to fp32, 1/s_g the correctly rounded fp32 reciprocal of
    fp32(s_g)."""
    return f32(f32(f32(grad_scale) * INV_C_A) * f32(1 / f32(s_g)))


def g_fp32(terms: dict, factor) -> torch.Tensor:
    """g = (((factor delta) s) (1 - s)) with every product rounded to fp32, from the float64 delta of ce_train's
    terms (float64)."""
    g = round_f32(factor * round_f32(terms["delta"]))
    g = round_f32(g * terms["s"])
    return round_f32(g * (1 - terms["s"]))


def assert_e5m2_matches(got: torch.Tensor, g32: torch.Tensor, what: str, rel: float = 3e-5,
                        max_fraction: float = 1e-2) -> None:
    """got (e5m2 values, any float dtype) == round_e5m2(g32) except where g32 is within `rel` of an e5m2 rounding
    boundary (an fp32 implementation's few-ulp differences may cross it). Columns with one bf16 s share one g, so
    such boundaries come in clusters: max_fraction only keeps a case from being all boundaries."""
    got = got.double()
    want = round_e5m2(g32)
    diff = got != want
    loose = ambiguous(g32, round_e5m2, rel)
    assert not (diff & ~loose).any(), (f"{what}: {int((diff & ~loose).sum())} of {got.numel()} e5m2 values differ "
                                       f"away from rounding boundaries, e.g. got {got[diff & ~loose][:4].tolist()} "
                                       f"want {want[diff & ~loose][:4].tolist()}")
    assert loose.float().mean() <= max_fraction, f"{what}: the case is too close to rounding boundaries to test"
    assert torch.isfinite(got).all() and (got.abs() <= E5M2_MAX).all(), what
