"""The FP8 forward of the MLP up projection (training only), against its rules written out here: the per-matrix weight
scale s = bf16(fp32(max|W| * fp32(1/448))), the weight copy e4m3(bf16(fp32(W / s))) (two roundings), the per-call
activation scale r = fp32(448 * fp32(1 / max|u|)) with u8 = e4m3(fp32(u * r)), the dequantisation factor
q = fp32(fp32(s * max|u|) * fp32(1/448)), pre = bf16(fp32(acc * q)), post = bf16(relu(pre)^2), and a backward that is
the bf16 one at the FP8 forward's pre and post (straight through). e4m3 rounding (nearest, ties to even, subnormals
below 2^-6, saturating at 448) is transcribed in Python floats, not taken from torch's cast."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import train_gpt as tg
import triton_kernels as tk

C32 = float(np.float32(1 / 448))          # the record's fp32(1/448)


def e4m3(v: float) -> float:
    """Nearest float8_e4m3fn of v (ties to even), saturating at +-448."""
    a = abs(v)
    step = 2.0 ** -9 if a < 2.0 ** -6 else 2.0 ** (math.floor(math.log2(a)) - 3)
    r = min(round(a / step) * step, 448.0)          # a / step is exact (a power of two); round() ties to even
    return math.copysign(r, v)


def bf16(v: float) -> float:
    return torch.tensor(v, dtype=torch.float32).bfloat16().item()


def f32(v: float) -> float:
    return float(np.float32(v))


def weight_rules(w: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(e4m3 values as float64, s) of a bf16 weight by the rules above."""
    A = max(w.double().abs().max().item(), bf16(1e-12))
    s = bf16(f32(A * C32))
    quotients = (w.float() / torch.tensor(s, dtype=torch.float32)).bfloat16().double()   # fp32 division, then bf16
    return torch.tensor([e4m3(v) for v in quotients.flatten().tolist()], dtype=torch.float64).view(w.shape), s


def input_rules(u: torch.Tensor, s: float) -> tuple[torch.Tensor, float]:
    """(e4m3 values as float64, q) of a bf16 MLP input."""
    a = max(u.double().abs().max().item(), bf16(1e-12))
    r = f32(448.0 * f32(1.0 / a))
    scaled = (u.float() * torch.tensor(r, dtype=torch.float32)).double()                 # fp32 products
    return torch.tensor([e4m3(v) for v in scaled.flatten().tolist()], dtype=torch.float64).view(u.shape), \
        f32(f32(s * a) * C32)


def test_e4m3_transcription_agrees_with_torchs_cast_where_both_are_defined():
    values = torch.linspace(-460, 460, 20001, dtype=torch.float64)
    values = torch.cat([values, 2.0 ** -torch.arange(0, 12, 0.25, dtype=torch.float64)])
    ours = torch.tensor([e4m3(v) for v in values.tolist()], dtype=torch.float64)
    assert torch.equal(ours, values.float().to(torch.float8_e4m3fn).double())
    assert e4m3(100.0) == 96.0 and e4m3(100.0001) == 104.0 and e4m3(450.0) == 448.0 and e4m3(2.0 ** -11) == 0.0


def test_weight_copy_follows_the_rules_with_both_roundings():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(256, 128, generator=g) * 0.02).bfloat16()
    w8, s = tk.quantize_mlp_weight(w)
    want, s_want = weight_rules(w)
    assert w8.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.dim() == 0
    assert s.item() == s_want and torch.equal(w8.double(), want)
    # the bf16 rounding before e4m3 matters (ties like 100.0001 -> bf16 100 -> 96, where one rounding gives 104)
    direct = torch.tensor([e4m3(v) for v in (w.float() / s).double().flatten().tolist()]).view(w.shape)
    assert (direct != want).sum() > 0
    # no element saturates: the largest magnitude lands on 448 exactly
    assert w8.double().abs().max().item() == 448.0 and w8.double().abs().max() == want.abs().max()


def test_the_integer_bf16_rounding_is_the_cast_ties_included():
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.randn(4096, generator=g) * 10.0 ** torch.randint(-30, 30, (4096,), generator=g),
                   torch.tensor([0.0, -0.0, 1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(1 + 2.0 ** -8), 3.0e38])])
    assert torch.equal(tk._round_to(x, torch.bfloat16), x.bfloat16().float())


def test_compiled_weight_copy_is_the_eager_one_bit_for_bit():
    """The training forward quantises inside the compiled graph, whose fused kernels would skip a
    bf16 round trip: the scale and the double rounding must survive torch.compile."""
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(384, 128, generator=g) * 0.02).bfloat16()
    want, s_want = tk.quantize_mlp_weight(w)
    torch._dynamo.reset()
    got, s_got = torch.compile(tk.quantize_mlp_weight, backend="inductor")(w)
    assert torch.equal(s_got, s_want) and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_input_quantisation_follows_the_rules_per_call():
    g = torch.Generator().manual_seed(1)
    u = torch.randn(64, 128, generator=g).bfloat16()
    s = torch.tensor(bf16(3e-5), dtype=torch.float32)
    u8, q = tk.quantize_mlp_input(u, s)
    want, q_want = input_rules(u, s.item())
    assert u8.dtype == torch.float8_e4m3fn and torch.equal(u8.double(), want) and q.item() == q_want
    assert u8.double().abs().max().item() == 448.0
    # one scale per call: half the rows alone get their own (larger) scale
    quiet = u[:32] * 0.25
    u8_quiet, q_quiet = tk.quantize_mlp_input(quiet, s)
    assert torch.equal(u8_quiet.double(), input_rules(quiet, s.item())[0]) and q_quiet.item() < q.item()


def test_the_records_worked_example():
    u = torch.tensor([[0.5, -1.25, 3, 0.10009765625, -0.030029296875, 2.5, -4.75, 0.0078125],
                      [1, 0.2001953125, -0.6015625, 7.5, -2, 0.0150146484375, 0.330078125, -1.1015625]]).bfloat16()
    w = torch.tensor([[0.03125, -0.01, 0.002, 0.0205, -0.0311, 0.0007, 0.015, -0.022],
                      [-0.005, 0.0123, 0.027, -0.0009, 0.018, -0.024, 0.0301, 0.011],
                      [0.0001, -0.0002, 0.0003, 0.025, -0.0125, 0.00625, -0.003125, 0.029]]).bfloat16()
    w8, s = tk.quantize_mlp_weight(w)
    assert s.item() == 6.961822509765625e-05
    assert w8.float().tolist() == [[448, -144, 28, 288, -448, 10, 224, -320], [-72, 176, 384, -13, 256, -352, 448, 160],
                                   [1.5, -3, 4.5, 352, -176, 88, -44, 416]]
    u8, q = tk.quantize_mlp_input(u, s)
    assert u8.float().tolist() == [[30, -72, 176, 6, -1.75, 144, -288, 0.46875],
                                   [60, 12, -36, 448, -120, 0.875, 20, -64]]
    assert q.item() == 1.1654836953312042e-06
    acc = u8.double() @ w8.double().T                                      # K = 8: exact
    assert acc.tolist() == [[-31974, -127411, 29012], [231896.75, -54164, 151281]]
    pre = (acc.float() * q).bfloat16()
    assert pre.float().tolist() == [[-0.037353515625, -0.1484375, 0.03369140625],
                                    [0.26953125, -0.06298828125, 0.1767578125]]
    assert F.relu(pre).square().float().tolist() == [[0, 0, 0.00113677978515625], [0.07275390625, 0, 0.03125]]
    # the FP8 reference op reaches the same post (its output is post @ c_proj)
    c_proj = torch.eye(3, 8).bfloat16()
    assert torch.equal(tk.relu2_mlp_reference(u, w, c_proj, fp8=True)[:, :3], F.relu(pre).square())
    assert (tk.relu2_mlp_reference(u, w, c_proj)[:, :3] != F.relu(pre).square()).any()   # bf16 path: other numbers


def test_fp8_reference_forward_and_straight_through_backward():
    g = torch.Generator().manual_seed(2)
    M, D, H = 48, 64, 96
    x = torch.randn(M, D, generator=g).bfloat16().requires_grad_()
    c_fc = (torch.randn(H, D, generator=g) * D ** -0.5).bfloat16().requires_grad_()
    c_proj = (torch.randn(H, D, generator=g) * H ** -0.5).bfloat16().requires_grad_()
    out = tk.relu2_mlp_reference(x, c_fc, c_proj, fp8=True)
    w8, s = weight_rules(c_fc.detach())
    u8, q = input_rules(x.detach(), s)
    pre = ((u8 @ w8.T).float() * q).bfloat16()              # exact products, one fp32 rounding of the sum
    post = F.relu(pre).square()
    assert (out.double() - (post @ c_proj.detach()).double()).abs().max() <= 2 ** -7 * out.double().abs().max()
    grad = torch.randn(M, D, generator=g).bfloat16()
    dx, dc_fc, dc_proj = torch.autograd.grad(out, (x, c_fc, c_proj), grad)
    # the bf16 backward's formulas at the FP8 forward's pre and post, in float64
    W1, W2, u, g64 = c_fc.detach().double(), c_proj.detach().double(), x.detach().double(), grad.double()
    dpre = (2 * (g64 @ W2.T).bfloat16().double() * pre.double().clamp_min(0)).bfloat16().double()
    for name, got, want in (("dc_proj", dc_proj, post.double().T @ g64), ("dc_fc", dc_fc, dpre.T @ u),
                            ("dx", dx, dpre @ W1)):
        assert got.dtype == torch.bfloat16
        assert (got.double() - want).abs().max() <= 2 ** -7 * want.abs().max(), name
    # it is the FP8 pre that the backward uses: the bf16 path's dc_proj differs by more than rounding
    ref = tk.relu2_mlp_reference(x, c_fc, c_proj)
    bf16_dc_proj = torch.autograd.grad(ref, c_proj, grad)[0]
    assert (bf16_dc_proj.double() - dc_proj.double()).abs().max() > 2 ** -5 * dc_proj.double().abs().max()


def test_the_model_runs_the_fp8_up_projection_in_training_only(monkeypatch):
    """Every layer's MLP is the FP8 one (FP8 up projection, FP8 down product) in training, the bf16 post-only MLP in
    eval, and the bf16 one always when --fp8_mlp=false."""
    from test_model import GPT, batch, masked_sdpa, randomize, tiny_cfg
    monkeypatch.setattr(tg, "varlen_attention", masked_sdpa)
    for fp8_mlp in (True, False):
        torch.manual_seed(0)
        model = GPT(tiny_cfg(fp8_mlp=fp8_mlp), torch.device("cpu"), tg.kernel_ops("fused", "cpu"))
        randomize(model)
        seen = []
        real, real_down = model.ops.relu2_mlp, model.ops.relu2_mlp_fp8_down
        model.ops = tg.dataclasses.replace(
            model.ops, relu2_mlp=lambda x, a, b, fp8: seen.append(fp8) or real(x, a, b, fp8),
            relu2_mlp_fp8_down=lambda *args: seen.append("down") or real_down(*args))
        inputs, targets, cu = batch(T=32, docs=(0, 9))
        model(inputs, targets, cu, 1, 3, torch.tensor([1.0, 0.5]), 64)
        model.eval()
        with torch.no_grad():
            model(inputs, targets, cu, 1, 3, torch.tensor([1.0]), 64)
        L = model.hp.num_layers
        assert seen == ["down" if fp8_mlp else False] * L + [False] * L
