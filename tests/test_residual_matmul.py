"""unfuse_residual_addmm: inductor's addmm(C, A, B) of a bf16 matrix C becomes add(mm(A, B), C), so torch no longer
copies C into the output before the GEMM. Checked on FX graphs, through real CPU inductor compilations (where the
addmm fusion fires for every reader, so the rewrite is visible), and against a float64 transcription of both roundings.
The GPU side (where the fusion fires only when a reduction reads the sum) is in test_model_gpu.py."""
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import train_gpt as tg


def _operands(m=64, k=96, n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).bfloat16()
    b = torch.randn(k, n, generator=g).bfloat16()
    c = torch.randn(m, n, generator=g).bfloat16()
    return a, b, c


def _targets(graph):
    return [n.target for n in graph.nodes if n.op == "call_function"]


def test_only_a_half_precision_matrix_addend_with_unit_scales_is_rewritten():
    aten = torch.ops.aten
    a, b, c = _operands()
    bias, c32 = c[0].clone(), c.float()

    def f(c, a, b, bias, c32, a32, b32):
        return (torch.addmm(c, a, b),                  # the residual form: rewritten
                torch.addmm(bias, a, b),               # a 1-D bias (F.linear's): kept
                torch.addmm(c, a, b, beta=0.5),        # scaled: kept
                torch.addmm(c32, a32, b32))            # fp32: kept

    args = (c, a, b, bias, c32, a.float(), b.float())
    gm = make_fx(f, tracing_mode="fake")(*args)
    assert _targets(gm.graph).count(aten.addmm.default) == 4
    assert tg.unfuse_residual_addmm(gm.graph) == 1
    gm.recompile()
    targets = _targets(gm.graph)
    assert targets.count(aten.addmm.default) == 3
    assert targets.count(aten.mm.default) == 1 and targets.count(aten.add.Tensor) == 1
    for node in gm.graph.nodes:                         # inductor lowers from these
        if node.target in (aten.mm.default, aten.add.Tensor):
            assert node.meta["val"].shape == (64, 48) and node.meta["val"].dtype == torch.bfloat16
    got, expected = gm(*args), f(*args)
    assert torch.equal(got[0], (a @ b) + c)             # two roundings, bitwise
    for g, e in zip(got[1:], expected[1:]):
        assert torch.equal(g, e)


def _residual_then_norm(x, y, w):
    s = x + y @ w
    return s, s * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True)).to(s.dtype)


def test_a_compiled_residual_sum_is_the_rounded_product_plus_the_stream(compiler_settings_restored, monkeypatch):
    """Inductor compiles `x + y @ w` into one addmm; configure_compiler installs the pass, which rewrites it in the
    forward graph, and the compiled sum is then exactly bf16(bf16(y @ w) + x), as eager computes it. Whether this
    CPU's addmm rounds once or twice does not enter the verdict: the rewrite is counted, and both sides of each
    comparison run the same CPU kernels."""
    from torch._inductor import config as inductor_config
    a, b, c = _operands(m=128, k=256, n=64, seed=1)
    monkeypatch.setattr(inductor_config, "force_disable_caches", True)   # the pass must run, not a cached graph

    torch._dynamo.reset()
    plain, _ = torch.compile(_residual_then_norm, fullgraph=True)(c, a, b)
    assert torch.equal(plain, torch.addmm(c, a, b))     # inductor's own fusion

    tg.configure_compiler()
    rewrites, unfuse = [], tg.unfuse_residual_addmm
    monkeypatch.setattr(tg, "unfuse_residual_addmm", lambda graph: rewrites.append(unfuse(graph)))
    torch._dynamo.reset()
    s, normed = torch.compile(_residual_then_norm, fullgraph=True)(c, a, b)
    assert rewrites == [1]
    assert torch.equal(s, (a @ b) + c)
    torch.testing.assert_close(normed, _residual_then_norm(c, a, b)[1], rtol=2 ** -6, atol=0)  # one bf16 rounding
    torch._dynamo.reset()


def test_both_roundings_against_float64():
    """The unfused sum is bf16(bf16(A @ B) + C): within half an ulp of the product plus half an ulp of the sum of the
    exact float64 value (plus the fp32 accumulation's own bound), where a single rounding would need only the
    latter. A transcription in float64, whatever CPU computed the bf16 product."""
    a, b, c = _operands(m=96, k=384, n=80, seed=2)
    a64, b64, c64 = a.double(), b.double(), c.double()
    exact = a64 @ b64 + c64
    accumulation = 384 * 2.0 ** -24 * (a64.abs() @ b64.abs())     # fp32 accumulation of K products

    def half_ulp(t):                                    # half an ulp of bf16 (8 significant bits) at |t|
        e = torch.floor(torch.log2(t.abs().clamp_min(2.0 ** -126)))
        return 2.0 ** (e - 8)

    unfused = ((a @ b) + c).double()
    mm = (a @ b).double()
    assert ((unfused - exact).abs() <= half_ulp(mm) + half_ulp(unfused) + accumulation * 1.01).all()
    # and the extra rounding is visible: the unfused sum is off by more than the fused bound somewhere
    assert ((unfused - exact).abs() > half_ulp(unfused) + accumulation * 1.01).any()


def test_a_graph_without_shapes_is_left_alone():
    """Nodes without the tensor metadata the rewrite needs (a graph traced without fake tensors) are skipped."""
    gm = torch.fx.symbolic_trace(lambda c, a, b: torch.ops.aten.addmm.default(c, a, b))
    assert tg.unfuse_residual_addmm(gm.graph) == 0
    a, b, c = _operands()
    assert torch.equal(gm(c, a, b), torch.addmm(c, a, b))
