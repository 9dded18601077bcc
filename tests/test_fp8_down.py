"""The FP8 down projection with delayed scaling (training only), against its rules written out here in Python floats
(numpy float32, bf16 through torch's cast, e4m3 by test_fp8_mlp's transcription):
* activations: post8 = e4m3(min(fp32(post * fp32(1 / a)), 448)); after the forward a <- fp32(max(m, 1e-12) *
  fp32(1.80/448)), m the max of post in that forward; a starts at 1.0; one chain per batch slice;
* weights, refreshed after every optimizer step (and at init / after the reset): in a bootstrap c_next <-
  bf16(bf16(max(max|W2|, 1e-12)) / 448); then W2_8 = e4m3(clamp(fp32(W2 / c_next), +-448)), c <- c_next, c_next <-
  fp32(max(max|W2|, 1e-12) * fp32(1.12/448)); the refreshes after steps 0..15 bootstrap;
* the product bf16(fp32(sum post8 W2_8) * fp32(a c)); the backward bf16 (the post-only one)."""
import copy

import numpy as np
import pytest
import torch

import triton_kernels as tk
from test_fp8_mlp import bf16, e4m3, f32

FLOOR = f32(1e-12)


def e4m3_tensor(values: torch.Tensor) -> torch.Tensor:
    return torch.tensor([e4m3(v) for v in values.flatten().tolist()], dtype=torch.float64).view(values.shape)


class Transcription:
    """The scale rules above, one Python float per scale."""

    def __init__(self, n_slots: int):
        self.used = [1.0] * n_slots
        self.next = [1.0] * n_slots

    def refresh(self, w2: torch.Tensor, bootstrap: bool) -> tuple[torch.Tensor, list[int]]:
        """-> (W2_8 as float64 (S, H, D), clipped entries per slot)."""
        w8, clipped = [], []
        for s in range(w2.shape[0]):
            m = w2[s].double().abs().max().item()
            if bootstrap:
                self.next[s] = bf16(bf16(max(m, FLOOR)) / 448)
            c = self.next[s]
            quotients = (w2[s].float() / torch.tensor(c, dtype=torch.float32)).double()  # fp32 division
            clipped.append(int((quotients.abs() > 448).sum()))
            w8.append(e4m3_tensor(quotients.clamp(-448, 448)))
            self.used[s] = c
            self.next[s] = f32(max(m, FLOOR) * f32(1.12 / 448))
        return torch.stack(w8), clipped


def act_rules(post: torch.Tensor, a: float) -> tuple[torch.Tensor, int, float]:
    """(post8 as float64, clipped entries, the next a) of one forward."""
    inv = f32(1 / a)
    scaled = (post.float() * torch.tensor(inv, dtype=torch.float32)).double()
    return (e4m3_tensor(scaled.clamp_max(448)), int((scaled > 448).sum()),
            f32(max(post.double().max().item(), FLOOR) * f32(1.80 / 448)))


def test_the_constants_are_the_records():
    assert tk.FP8_DOWN_ACT_FACTOR == f32(1.80 / 448)
    assert np.float32(tk.FP8_DOWN_ACT_FACTOR).view(np.uint32) == 0x3B83A83B
    assert tk.FP8_DOWN_WEIGHT_FACTOR == f32(1.12 / 448)
    assert np.float32(tk.FP8_DOWN_WEIGHT_FACTOR).view(np.uint32) == 0x3B23D70A
    assert [tk.fp8_down_bootstraps(s) for s in (None, 0, 15, 16, 17)] == [True, True, True, False, False]


def test_weight_scales_worked_values():
    """Zero weights (the init): 2.2343238370581275e-15; a bootstrap scale bf16(0.03125 / 448) sits below 0.03125 / 448,
    so the largest entries clip; a delayed one is fp32(m * fp32(1.12/448))."""
    w2 = torch.zeros(3, 64, 32, dtype=torch.bfloat16)
    w2[1, 5, 7] = 0.03125
    w2[2, 0, 0] = -0.050048828125
    c = tk.fp8_bootstrap_weight_scales(w2)
    assert c.dtype == torch.float32 and c.tolist() == [2.2343238370581275e-15, 6.961822509765625e-05,
                                                       bf16(0.050048828125 / 448)]
    assert c[1].item() < 0.03125 / 448 and tk.fp8_clipped_count(w2, c).item() == 2
    _, used, nxt = tk.fp8_down_weight_refresh(w2, torch.ones(3), bootstrap=False, fused=False)
    assert used.tolist() == [1.0] * 3
    assert nxt.tolist() == [f32(FLOOR * f32(1.12 / 448)), f32(0.03125 * f32(1.12 / 448)), 1.2512206740211695e-04]


def test_compiled_bootstrap_scales_are_the_eager_ones():
    """torch.compile would fuse the two bf16 roundings into fp32 arithmetic; the integer rounding keeps them."""
    g = torch.Generator().manual_seed(0)
    w2 = (torch.randn(12, 96, 64, generator=g) * 10.0 ** torch.randint(-6, 2, (12, 1, 1), generator=g)).bfloat16()
    w2[3] = 0
    torch._dynamo.reset()
    got = torch.compile(tk.fp8_bootstrap_weight_scales, backend="inductor")(w2)
    want = [bf16(bf16(max(w2[s].double().abs().max().item(), FLOOR)) / 448) for s in range(12)]
    assert got.tolist() == want and torch.equal(got, tk.fp8_bootstrap_weight_scales(w2))


def test_the_activation_worked_example():
    """Previous amax 5.0 -> a = 0.0200892873108387 (1 / a = 49.777774810791016); the values below quantise as listed,
    the last two at 448."""
    state = tk.Fp8DownState(n_slices=1, n_layers=1, n_slots=1)
    state.update_act_scales(0, torch.tensor([[3.0, 5.0, 0.5]]))
    a = state.act_scales[0, :1]
    assert a.item() == 0.0200892873108387 and (1 / a).item() == 49.777774810791016
    post = torch.tensor([[1.0014e-4, 9.9945e-4, 0.010009765625, 0.5, 2.703125, 8.875, 20.0]]).bfloat16()
    post8 = tk.quantize_post_reference(post, a)
    assert post8.dtype == torch.float8_e4m3fn
    assert post8.float().tolist() == [[0.005859375, 0.05078125, 0.5, 24, 128, 448, 448]]
    assert (post8.float() * a)[0].tolist() == pytest.approx([1.177e-4, 1.020e-3, 0.010045, 0.48214, 2.57143, 9.0, 9.0],
                                                            rel=1e-3)
    assert tk.fp8_clipped_count(post, a).item() == 1         # 8.875 / a = 441.8 rounds to 448; 20 / a clips


def grow(w2: torch.Tensor, step: int, g: torch.Generator) -> torch.Tensor:
    """An optimizer step's weights: a small update, and at some steps one entry per slot grown by 20% (beyond the
    delayed scale's 12% headroom)."""
    w = w2.float() + 0.002 * torch.randn(w2.shape, generator=g)
    if step % 5 == 3:
        flat = w.view(w.shape[0], -1)
        idx = flat.abs().argmax(dim=1)
        flat[torch.arange(w.shape[0]), idx] *= 1.2
    return w.bfloat16()


def test_the_weight_state_machine_over_twenty_steps():
    """At init (W2 = 0 for slot 0) and after optimizer steps 0..19: the scales and every W2_8 entry are the
    transcription's, the scale a forward of step s uses is bf16(m_{s-1} / 448) for 1 <= s <= 16 and
    fp32(m_{s-2} * fp32(1.12/448)) from s = 17, and the clipped counts match (bootstrap clips from G15, delayed clips
    where an entry grew past the headroom)."""
    g = torch.Generator().manual_seed(3)
    S, H, D = 3, 64, 48
    w2 = (torch.randn(S, H, D, generator=g) * 0.02).bfloat16()
    w2[0] = 0
    state, ref = tk.Fp8DownState(2, 2, S), Transcription(S)
    state.refresh_weights(w2, bootstrap=True)
    ref.refresh(w2, bootstrap=True)
    assert state.weight_scales[0].item() == 2.2343238370581275e-15 and (state.weights8[0].float() == 0).all()
    storage = state.weights8.data_ptr()            # refreshed in place: a compiled forward keeps its tensor
    amaxes = []
    clip_kinds = set()
    for s in range(20):
        w2 = grow(w2, s, g)
        amaxes.append(w2.double().abs().amax(dim=(1, 2)).tolist())
        state.refresh_weights(w2, tk.fp8_down_bootstraps(s))
        want8, clipped = ref.refresh(w2, tk.fp8_down_bootstraps(s))
        assert state.weight_scales.tolist() == ref.used and state.next_weight_scales.tolist() == ref.next, s
        assert state.weights8.shape == (S, D, H) and state.weights8.dtype == torch.float8_e4m3fn
        assert torch.equal(state.weights8.double().mT, want8), s
        assert [tk.fp8_clipped_count(w2[i], state.weight_scales[i]).item() for i in range(S)] == clipped, s
        fwd = s + 1            # the step whose forward uses these scales
        closed = ([bf16(m / 448) for m in amaxes[fwd - 1]] if fwd <= 16
                  else [f32(m * f32(1.12 / 448)) for m in amaxes[fwd - 2]])
        assert state.weight_scales.tolist() == closed, fwd
        if sum(clipped):
            clip_kinds.add("bootstrap" if fwd <= 16 else "delayed")
    assert clip_kinds == {"bootstrap", "delayed"}, "the sequence must exercise both kinds of saturation"
    assert state.weights8.data_ptr() == storage


def test_the_activation_chain_per_slice_over_steps():
    """Per slice and layer: the post8 of each forward and the a it leaves are the transcription's; the first forward
    uses a = 1; growth past 1.8x the previous max clips, counted."""
    g = torch.Generator().manual_seed(4)
    n_slices, L = 2, 3
    state = tk.Fp8DownState(n_slices, L, L + 1)
    a_ref = [[1.0] * L for _ in range(n_slices)]
    clips = 0
    for step in range(6):
        for b in range(n_slices):
            scale = 1 + 2.5 * (step == 3)                 # one forward far above the previous max
            posts = [(torch.randn(16, 40, generator=g).clamp_min(0) ** 2 * scale * (l + 1)).bfloat16()
                     for l in range(L)]
            maxima = []
            for l, post in enumerate(posts):
                a = state.down_operands(b, l)[0] if state.weights8 is not None else state.act_scales[b, l:l + 1]
                assert a.item() == a_ref[b][l]
                post8 = tk.quantize_post_reference(post, a)
                want, clipped, a_next = act_rules(post, a_ref[b][l])
                assert torch.equal(post8.double(), want) and tk.fp8_clipped_count(post, a).item() == clipped
                clips += clipped
                a_ref[b][l] = a_next
                maxima.append(post.float().amax().reshape(1))
            state.update_act_scales(b, torch.stack(maxima))
            assert state.act_scales[b].tolist() == a_ref[b]
    assert clips > 0


def mlp_inputs(g, M=16, D=32, H=64):
    x = torch.randn(M, D, generator=g).bfloat16()
    c_fc = (torch.randn(H, D, generator=g) / D ** 0.5).bfloat16()
    c_proj = (torch.randn(H, D, generator=g) / H ** 0.5).bfloat16()
    return x, c_fc, c_proj


def train_steps(states, owners, steps, n_slices, L, seed, g_state=None):
    """A training loop's FP8 down projection on the references: at each step every slice b (its rank = owners[b])
    runs L MLP layers and advances its chain; the weights move and refresh after each step. -> (the outputs, the
    generator's state, the last weights)."""
    g = torch.Generator().manual_seed(seed)
    if g_state is not None:
        g.set_state(g_state)
    outs, w2 = [], None
    for s in steps:
        c_projs = [mlp_inputs(g)[2] for _ in range(L)]
        c_fcs = [mlp_inputs(g)[1] for _ in range(L)]
        for b in range(n_slices):
            x = mlp_inputs(g)[0]
            state = states[owners[b]]
            maxima = []
            for l in range(L):
                out, amax = tk.relu2_mlp_fp8_down_reference(x, c_fcs[l], c_projs[l], *state.down_operands(b, l))
                outs.append(out)
                maxima.append(amax)
            state.update_act_scales(b, torch.stack(maxima))
        w2 = torch.stack(c_projs + [torch.zeros_like(c_projs[0])])          # the padding slot
        for state in states:
            state.refresh_weights(w2, tk.fp8_down_bootstraps(s))
    return outs, g.get_state(), w2


def fresh(n_slices, L):
    """A state after its init refresh (the model's c_proj starts at 0)."""
    state = tk.Fp8DownState(n_slices, L, L + 1)
    state.refresh_weights(torch.zeros(L + 1, 64, 32, dtype=torch.bfloat16), bootstrap=True)
    return state


def test_one_rank_with_two_slices_equals_two_ranks():
    """W = 1 running slices 0 and 1 in turn gives the outputs and scales of W = 2 (rank r running slice r): each
    slice has its own chain. One chain shared by a rank's slices (the record at W < 8) gives other numbers."""
    L, steps = 2, range(4)
    one = fresh(2, L)
    outs_w1, *_ = train_steps([one], [0, 0], steps, 2, L, seed=5)
    ranks = [fresh(2, L), fresh(2, L)]
    assert tk.owned_slices(0, 2, 2) == [0] and tk.owned_slices(1, 2, 2) == [1]
    assert tk.owned_slices(1, 4, 8) == [1, 5]
    outs_w2, *_ = train_steps(ranks, [0, 1], steps, 2, L, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(outs_w1, outs_w2))
    for b in range(2):
        assert torch.equal(one.act_scales[b], ranks[b].act_scales[b])
        assert (ranks[1 - b].act_scales[b] == 1).all(), "a rank leaves the slices it does not run alone"
    shared = fresh(1, L)                   # the record's per-rank chain: every slice advances row 0
    shared_outs = []
    g = torch.Generator().manual_seed(5)
    for s in steps:
        c_projs = [mlp_inputs(g)[2] for _ in range(L)]
        c_fcs = [mlp_inputs(g)[1] for _ in range(L)]
        for b in range(2):
            x = mlp_inputs(g)[0]
            maxima = []
            for l in range(L):
                out, amax = tk.relu2_mlp_fp8_down_reference(x, c_fcs[l], c_projs[l], *shared.down_operands(0, l))
                shared_outs.append(out)
                maxima.append(amax)
            shared.update_act_scales(0, torch.stack(maxima))
        shared.refresh_weights(torch.stack(c_projs + [torch.zeros_like(c_projs[0])]), tk.fp8_down_bootstraps(s))
    assert not all(torch.equal(a, b) for a, b in zip(outs_w1, shared_outs))


def test_save_and_restore_mid_sequence_equals_the_straight_run():
    """state_dict holds plain fp32 tensors; loading them into a fresh state and rebuilding the FP8 weights from the
    current weights continues bit for bit, across the end of the bootstrap (steps 14..18)."""
    L = 2
    straight = fresh(2, L)
    outs, *_ = train_steps([straight], [0, 0], range(19), 2, L, seed=7)
    first = fresh(2, L)
    outs_a, g_state, w2 = train_steps([first], [0, 0], range(15), 2, L, seed=7)
    saved = copy.deepcopy(first.state_dict())
    assert sorted(saved) == ["act_scales", "next_weight_scales", "weight_scales"]
    assert all(type(t) is torch.Tensor and t.dtype == torch.float32 for t in saved.values())
    resumed = tk.Fp8DownState(2, L, L + 1)
    resumed.load_state_dict(saved)
    resumed.rebuild_weights8(w2)        # the weights of the last refresh: no scale moves
    assert torch.equal(resumed.weights8.view(torch.uint8), first.weights8.view(torch.uint8))
    assert all(torch.equal(a, b) for a, b in zip(resumed.state_dict().values(), first.state_dict().values()))
    outs_b, *_ = train_steps([resumed], [0, 0], range(15, 19), 2, L, seed=7, g_state=g_state)
    assert len(outs_a) + len(outs_b) == len(outs)
    assert all(torch.equal(a, b) for a, b in zip(outs_a + outs_b, outs))
    assert all(torch.equal(a, b) for a, b in zip(resumed.state_dict().values(), straight.state_dict().values()))
    assert torch.equal(resumed.weights8.view(torch.uint8), straight.weights8.view(torch.uint8))


def test_reset_restores_the_initial_state():
    """The warmup reset: every scale 1.0; with the bootstrap refresh that follows it the state is a fresh one's."""
    L = 2
    state = fresh(2, L)
    train_steps([state], [0, 0], range(3), 2, L, seed=11)
    assert (state.act_scales != 1).all() and (state.weight_scales != 1).all()
    state.reset()
    assert all((t == 1).all() for t in state.state_dict().values())
    new = fresh(2, L)
    state.refresh_weights(torch.zeros(L + 1, 64, 32, dtype=torch.bfloat16), bootstrap=True)
    assert all(torch.equal(a, b) for a, b in zip(state.state_dict().values(), new.state_dict().values()))
    assert torch.equal(state.weights8.view(torch.uint8), new.weights8.view(torch.uint8))


def test_the_product_and_its_backward():
    """out = bf16(fp32(post8 @ W2_8^T) * fp32(a c)) (K = 64: the fp32 sum of exact products within rounding of the
    float64 one); the backward is the bf16 post-only one, whatever the FP8 copies hold (straight through)."""
    g = torch.Generator().manual_seed(12)
    x, c_fc, c_proj = mlp_inputs(g)
    a = torch.tensor([0.013], dtype=torch.float32)
    w8t, c, _ = tk.fp8_down_weight_refresh(c_proj[None], torch.ones(1), bootstrap=True, fused=False)
    xr, fcr, pr = (t.clone().requires_grad_() for t in (x, c_fc, c_proj))
    out, amax = tk.relu2_mlp_fp8_down_reference(xr, fcr, pr, a, c, w8t[0])
    post = tk.relu2_up_post_reference(x, c_fc, fp8=True)
    assert amax.tolist() == [post.float().max().item()]
    post8 = e4m3_tensor((post.float() * (1 / a)).double().clamp_max(448))
    exact = (post8 @ w8t[0].double().mT) * (a * c).item()
    assert out.dtype == torch.bfloat16
    assert ((out.double() - exact).abs() <= 2 ** -8 * exact.abs() + 1e-6 * exact.abs().max()).all()
    grad = torch.randn(out.shape, generator=g).bfloat16()
    got = torch.autograd.grad(out, (xr, fcr, pr), grad)
    ref = tk.relu2_mlp_post_reference(xr, fcr, pr, fp8=True)
    want = torch.autograd.grad(ref, (xr, fcr, pr), grad)
    assert all(torch.equal(u, v) for u, v in zip(got, want))
    # another activation scale changes the forward (post8), never the backward
    out2, _ = tk.relu2_mlp_fp8_down_reference(xr, fcr, pr, a * 2, c, w8t[0])
    assert not torch.equal(out2, out)
    assert all(torch.equal(u, v) for u, v in zip(torch.autograd.grad(out2, (xr, fcr, pr), grad), want))


def test_bad_input_is_refused_with_the_fix():
    state = tk.Fp8DownState(2, 3, 4)
    with pytest.raises(ValueError, match="call refresh_weights"):
        state.down_operands(0, 0)
    with pytest.raises(ValueError, match=r"w2 must be \(4, H, D\)"):
        state.refresh_weights(torch.zeros(3, 8, 8, dtype=torch.bfloat16), bootstrap=True)
    with pytest.raises(ValueError, match=r"partial_amax must be \(3, P\)"):
        state.update_act_scales(0, torch.ones(2, 5))


def test_post8_of_every_bf16_post_is_the_rules_and_does_not_depend_on_the_division_form():
    """Exhaustive over the positive bf16 posts up to 1.8x the previous max, for several maxima: post8 is
    e4m3(min(fp32(post * fp32(1 / a)), 448)); the fp32 products differ from post / a in thousands of entries, but
    never across an e4m3 rounding boundary (a bf16 post times a scale lands on no e4m3 tie), so the kernel's division
    form cannot move post8."""
    bits = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16)
    every = bits.view(torch.bfloat16)
    for m in (5.0, 0.7, 3.0, 7.25, 23.5):
        post = every[every.float() <= 1.8 * m][None]
        state = tk.Fp8DownState(n_slices=1, n_layers=1, n_slots=1)
        state.update_act_scales(0, torch.tensor([[m]]))
        a = state.act_scales[0]
        inv = torch.tensor(f32(1 / a.item()), dtype=torch.float32)
        want = (post.float() * inv).clamp_max(448).to(torch.float8_e4m3fn)
        got = tk.quantize_post_reference(post, a)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), m
        divided = (post.float() / a).clamp_max(448)
        assert ((post.float() * inv) != divided).sum() > 100, m
        assert torch.equal(divided.to(torch.float8_e4m3fn).view(torch.uint8), want.view(torch.uint8)), m


def test_the_product_scales_by_the_fp32_product_of_the_two_scales():
    """The reference's epilogue is fp32(acc * fp32(a * c)), as _scaled_mm's tensor-wise scaling forms it (integer e4m3
    operands: the fp32 sums are exact); scaling by a and then by c rounds some entries otherwise."""
    g = torch.Generator().manual_seed(13)
    post8 = torch.randint(0, 17, (64, 32), generator=g).float().to(torch.float8_e4m3fn)
    w8t = torch.randint(-16, 17, (48, 32), generator=g).float().to(torch.float8_e4m3fn)
    a = torch.tensor([0.0123456], dtype=torch.float32)
    c = torch.tensor([7.654321e-5], dtype=torch.float32)
    acc = post8.double() @ w8t.double().mT                       # |acc| < 2^24: exact in fp32 as well
    got = tk.fp8_down_matmul_reference(post8, w8t, a, c, torch.float32)
    want = (acc.float() * (a * c)).float()
    assert torch.equal(got, want)
    assert not torch.equal(got, (acc.float() * a) * c)
    assert torch.equal(tk.fp8_down_matmul_reference(post8, w8t, a, c), want.bfloat16())
