"""CPU tests of the MODEL section of train_gpt.py against direct implementations written here.

The attention backend is replaced by `masked_sdpa`, a dense-mask stand-in defined in this file (the real
varlen_attention lives in another section). References use fp32 math on the model's bf16 weights, loops over tokens
and heads where the record's math is a per-token rule, and nothing from train_gpt except the parameters they read.
"""
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import train_gpt as tg
import triton_kernels as tk

EPS = 2.0 ** -23
CPU_OPS = tg.kernel_ops("fused", "cpu")   # off CUDA every op is its reference


def tiny_cfg(**overrides) -> tg.ModelConfig:
    cfg = tg.ModelConfig(
        vocab_size=256, model_dim=64, num_heads=4, head_dim=16, mlp_hidden=128, num_layers=6, num_value_embeds=3,
        attn_layout="PNN-NP", long_window_layers=(1, 4), ve_layout=(1, 2, -1, -1, 0, 2),
        skip_source_layer=1, skip_dest_layer=3, backout_layer=4, block_size=16,
        rope_base=1024.0, attn_scale=0.1, yarn_alpha=1.0, yarn_beta=32.0,
        fp8_scales=(100 / 448, 1.6 / 448, 0.75 / 448), use_fp8=False, attn_backend="test-sdpa", rotary_max_len=128)
    return replace(cfg, **overrides)


def real_cfg(**overrides) -> tg.ModelConfig:
    hp = tg.Hyperparameters()
    fields = {f: getattr(hp, f) for f in tg.ModelConfig.__dataclass_fields__ if hasattr(hp, f)}
    fields.update(attn_backend="test-sdpa", rotary_max_len=262_144)
    return replace(tg.ModelConfig(**fields), **overrides)


def masked_sdpa(q, k, v, cu_seqlens, max_seqlen, window, scale, backend):
    """Stand-in for varlen_attention: dense mask (same document, causal, key >= query - window), fp32 softmax."""
    assert backend == "test-sdpa" and q.dtype == torch.bfloat16 and q.shape == k.shape == v.shape
    T = q.shape[0]
    if not torch.compiler.is_compiling():
        assert int(cu_seqlens[-1]) == T and max_seqlen >= int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    pos = torch.arange(T)
    doc = torch.searchsorted(cu_seqlens.long(), pos, right=True)
    mask = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None]) & (pos[None, :] >= pos[:, None] - window)
    scores = torch.einsum("thd,shd->hts", q.float(), k.float()) * scale
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", probs, v.float()).bfloat16()


@pytest.fixture(autouse=True)
def _standin_attention(monkeypatch):
    monkeypatch.setattr(tg, "varlen_attention", masked_sdpa, raising=False)


def randomize(model: tg.GPT, seed: int = 0) -> None:
    """Non-zero values everywhere (the zero-initialised banks would hide whole paths)."""
    g = torch.Generator().manual_seed(seed)
    L = model.cfg.num_layers
    with torch.no_grad():
        for name, p in dict(model.named_parameters()).items():
            r = torch.randn(p.shape, generator=g)
            if name == "scalars":
                base = torch.cat([torch.full((L,), 1.1), torch.tensor([0.5, 1.0]).repeat(L),
                                  torch.tensor([0.3, 0.5, -1.5])])
                p.copy_(base + 0.1 * r)
            elif name == "x0_lambdas":
                p.copy_(0.3 * r)
            elif name in ("lm_head", "embed") or name.startswith("ve"):
                p.copy_(0.5 * r)
            elif name in ("attn", "mlp"):
                p.copy_(r * p.shape[-1] ** -0.5)
            else:
                p.copy_(0.5 * r)


def batch(T=64, V=256, seed=1, docs=(0, 20, 45, 64)):
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, V, (T,), generator=g, dtype=torch.int32)
    targets = torch.randint(0, V, (T,), generator=g, dtype=torch.int64)
    cu = torch.tensor(list(docs) + [T, T], dtype=torch.int32)  # trailing empty documents, like the padded loader
    return inputs, targets, cu


# ---- direct references ------------------------------------------------------------------------------------------

def f32_rms(x):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def omega_direct(head_dim, base):
    """Distinct frequencies f_j = base^(-j/(n-1)), n = head_dim/4, in float64."""
    n = head_dim // 4
    return torch.tensor([base ** (-j / (n - 1)) for j in range(n)], dtype=torch.float64)


def rotate_direct(vec, angle_pos, freqs):
    """Clockwise rotation of pairs (2m, 2m+1), m < len(freqs), by angle_pos * freqs[m]; other dims untouched."""
    out = vec.clone()
    for m, f in enumerate(freqs.tolist()):
        th = angle_pos * f
        a, b = vec[2 * m].item(), vec[2 * m + 1].item()
        out[2 * m] = math.cos(th) * a + math.sin(th) * b
        out[2 * m + 1] = math.cos(th) * b - math.sin(th) * a
    return out


def doc_of(cu, t):
    cu = cu.tolist()
    return max(j for j in range(len(cu) - 1) if cu[j] <= t < cu[j + 1])


def attention_direct(model, layer, u, ve, cu, window, *, swap_slot=True):
    """The attention sublayer (paired and normal) written out per token and head, in fp32.
    u (T, D) bf16 -> (T, D) fp32."""
    cfg = model.cfg
    T, D, H, hd, L = u.shape[0], cfg.model_dim, cfg.num_heads, cfg.head_dim, cfg.num_layers
    kind = cfg.attn_layout[layer]
    slot = sum(c != "-" for c in cfg.attn_layout[:layer])
    ve_slot = sum(j >= 0 for j in cfg.ve_layout[:layer])
    lam_qkv, lam_o = model.scalars[L + 2 * layer], model.scalars[L + 2 * layer + 1]
    S = model.attn[slot].detach()
    Wqkv = (lam_qkv * S[: 3 * D]).detach().bfloat16().float()   # weights rounded to bf16 after the lambda
    Wo = (lam_o * S[3 * D:]).detach().bfloat16().float()
    uf = u.float()
    qkv = uf @ Wqkv.T
    q = f32_rms(qkv[:, :D].view(T, H, hd))
    k = f32_rms(qkv[:, D: 2 * D].view(T, H, hd))
    v = qkv[:, 2 * D:].view(T, H, hd).clone()
    freqs = omega_direct(hd, cfg.rope_base)
    qr, kr = torch.empty_like(q), torch.empty_like(k)
    for t in range(T):
        for h in range(H):
            if kind == "P":
                angle = 2 * t + (h % 2 if swap_slot else int(h >= H // 2))
            else:
                angle = t
            qr[t, h] = rotate_direct(q[t, h], angle, freqs)
            kr[t, h] = rotate_direct(k[t, h], angle, freqs)
    if kind == "N" and layer in cfg.long_window_layers:
        shifted = kr.clone()
        for t in range(1, T):
            for lo, hi in ((hd // 4, hd // 2), (3 * hd // 4, hd)):
                shifted[t, :, lo:hi] = kr[t - 1, :, lo:hi]
        kr = shifted
    gate_in = uf[:, :12]
    if ve is not None:
        Gv = model.ve_gate_bank[ve_slot].detach().float()
        for t in range(T):
            for h in range(H):
                v[t, h] += 2 * torch.sigmoid(gate_in[t] @ Gv[h]) * ve[t, h * hd:(h + 1) * hd].float()
    y = torch.zeros(T, H, hd)
    if kind == "P":
        # doubled position P = 2t (heads < H/2) or 2t+1 (heads >= H/2), slot g = h mod H/2
        n = 2 * T
        slots = H // 2
        Q = torch.zeros(n, slots, hd); K = torch.zeros(n, slots, hd); Vd = torch.zeros(n, slots, hd)
        tok = [P // 2 for P in range(n)]
        for t in range(T):
            for h in range(H):
                P, g = 2 * t + int(h >= slots), h % slots
                Q[P, g], K[P, g], Vd[P, g] = qr[t, h], kr[t, h], v[t, h]
        Yd = torch.zeros(n, slots, hd)
        for P in range(n):
            keys = [P2 for P2 in range(n) if P2 <= P and P - P2 <= window and doc_of(cu, tok[P2]) == doc_of(cu, tok[P])]
            for g in range(slots):
                s = torch.stack([Q[P, g] @ K[P2, g] for P2 in keys]) * model.attn_scale
                Yd[P, g] = s.softmax(0) @ Vd[keys, g]
        for t in range(T):
            for h in range(H):
                y[t, h] = Yd[2 * t + int(h >= slots), h % slots]
    else:
        for t in range(T):
            keys = [t2 for t2 in range(T) if t2 <= t and t - t2 <= window and doc_of(cu, t2) == doc_of(cu, t)]
            for h in range(H):
                s = torch.stack([qr[t, h] @ kr[t2, h] for t2 in keys]) * model.attn_scale
                y[t, h] = s.softmax(0) @ v[keys, h]
    Ga = model.attn_gate_bank[slot].detach().float()
    for t in range(T):
        for h in range(H):
            y[t, h] *= torch.sigmoid(gate_in[t] @ Ga[h])
    return y.reshape(T, D) @ Wo.T


def hidden_direct(model, inputs, cu, ws_short, ws_long):
    """The whole trunk in fp32, layer wiring read from the config; returns rms(final x) (T, D)."""
    cfg = model.cfg
    L, bs = cfg.num_layers, cfg.block_size
    sc = model.scalars.detach()
    x0l = model.x0_lambdas.detach()
    ids = inputs.long()
    e = model.embed.detach().float()[ids]
    T = e.shape[0]
    w_smear = model.smear_gate.detach().float()[0]
    e2 = e.clone()
    for t in range(1, T):
        e2[t] = e[t] + sc[3 * L] * torch.sigmoid(e[t, :12] @ w_smear) * e[t - 1]
    x = x0 = f32_rms(e2)
    saved = {}
    for i in range(L):
        if i == cfg.skip_dest_layer:
            g = torch.sigmoid(sc[3 * L + 2]) * 2 * torch.sigmoid(x0[:, :12] @ model.skip_gate.detach().float()[0])
            x = x + g[:, None] * saved["skip"]
        x = (sc[0] + x0l[0]) * x if i == 0 else sc[i] * x + x0l[i] * x0
        if cfg.attn_layout[i] != "-":
            window = (ws_long if i in cfg.long_window_layers else ws_short) * bs
            j = cfg.ve_layout[i]
            ve = getattr(model, f"ve{j}").detach()[ids] if j >= 0 else None
            x = x + attention_direct(model, i, f32_rms(x).bfloat16(), ve, cu, window)
        c_fc, c_proj = model.mlp[i, 0].detach().float(), model.mlp[i, 1].detach().float()
        x = x + F.relu(f32_rms(x) @ c_fc.T).square() @ c_proj
        if i == cfg.skip_source_layer:
            saved["skip"] = x
        if i == cfg.backout_layer:
            saved["backout"] = x
    return f32_rms(x - sc[3 * L + 1] * saved["backout"])


def softcap(logits):
    return 23.0 * torch.sigmoid((logits.float() + 5.0) / 7.5)


def mtp_loss_direct(logits, targets, weights):
    """sum_i sum_k [i+k < T][w_k > 0] w_k (lse_i - z[i, targets[i+k]]), in float64 with explicit loops."""
    z = softcap(logits).double()
    lse = torch.logsumexp(z, -1)
    T = z.shape[0]
    total = 0.0
    for i in range(T):
        for k, w in enumerate(weights.tolist()):
            if i + k < T and w > 0:
                total += w * (lse[i] - z[i, targets[i + k]]).item()
    return total


def sigma_bf16(logits):
    """Record 80's training softcap sigma: sigmoid(l * fp32(1/C) + fp32(B/C)) rounded to bf16 (bf16 logits)."""
    return torch.sigmoid(logits.double() * tk.SOFTCAP_INV_C + tk.SOFTCAP_B_DIV_C).float().bfloat16().double()


def mtp_train_loss_direct(logits, targets, weights):
    """Record 80's training loss: sum_i sum_k [i+k < T] w_k (lse_i - 23 s[i, targets[i+k]]) with s = sigma_bf16 (no
    w_k > 0 test), float64 with explicit loops."""
    z = 23.0 * sigma_bf16(logits)
    lse = torch.logsumexp(z, -1)
    total = 0.0
    for i in range(z.shape[0]):
        for k, w in enumerate(weights.tolist()):
            if i + k < z.shape[0]:
                total += w * (lse[i] - z[i, targets[i + k]]).item()
    return total


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ---- parameters ---------------------------------------------------------------------------------------------------

def test_real_config_parameter_counts():
    model = tg.GPT(real_cfg(rotary_max_len=16), torch.device("meta"), CPU_OPS)
    counts = {k: p.numel() for k, p in dict(model.named_parameters()).items()}
    assert list(counts) == ["attn", "mlp", "lm_head", "embed", "ve0", "ve1", "ve2", "attn_gate_bank", "ve_gate_bank",
                            "smear_gate", "skip_gate", "x0_lambdas", "scalars"]
    assert counts["attn"] == 23_592_960 and counts["mlp"] == 56_623_104
    assert counts["lm_head"] == counts["embed"] == counts["ve0"] == 38_633_472
    gates = ("attn_gate_bank", "ve_gate_bank", "smear_gate", "skip_gate")
    assert [counts[k] for k in gates] == [720, 360, 12, 12]
    assert counts["x0_lambdas"] == 11 and counts["scalars"] == 36
    # the record: 273,384,579 with its 4 vestigial scalar pads, which this model drops
    assert sum(counts.values()) == 273_384_579 - 4
    assert sum(p.numel() for p in model.parameters()) == sum(counts.values())
    assert model.attn.shape == (10, 3072, 768) and model.mlp.shape == (12, 2, 3072, 768)
    assert model.lm_head.shape == (768, 50304) and model.embed.shape == (50304, 768)


def test_tiny_parameter_shapes_dtypes_and_init():
    cfg = tiny_cfg(vocab_size=1024)
    torch.manual_seed(123)
    model = tg.GPT(cfg, torch.device("cpu"), CPU_OPS)
    D, H, L, V = 64, 4, 6, 1024
    P = dict(model.named_parameters())
    assert {id(p) for p in P.values()} == {id(p) for p in model.parameters()} and len(P) == 13
    n_attn, n_ve = 5, 4
    # the banks pad to a multiple of 8 matrices: 5 attention slices of 4 -> 6, 6 MLP slices of 2 -> 8
    expect = {"attn": ((n_attn + 1, 4 * D, D), torch.bfloat16), "mlp": ((L + 2, 2, 128, D), torch.bfloat16),
              "lm_head": ((D, V), torch.bfloat16), "embed": ((V, D), torch.bfloat16),
              "ve0": ((V, D), torch.bfloat16), "ve1": ((V, D), torch.bfloat16), "ve2": ((V, D), torch.bfloat16),
              "attn_gate_bank": ((n_attn, H, 12), torch.bfloat16), "ve_gate_bank": ((n_ve, H, 12), torch.bfloat16),
              "smear_gate": ((1, 12), torch.bfloat16), "skip_gate": ((1, 12), torch.bfloat16),
              "x0_lambdas": ((L,), torch.float32), "scalars": ((3 * L + 3,), torch.float32)}
    for name, (shape, dtype) in expect.items():
        assert tuple(P[name].shape) == shape and P[name].dtype == dtype, name
    b = math.sqrt(3) / math.sqrt(D)
    qkv = P["attn"][:n_attn, : 3 * D].float()
    assert (P["attn"][:, 3 * D:] == 0).all() and (P["attn"][n_attn:] == 0).all()      # O rows and the pad slice
    ulp = 1 + 2 ** -8  # the bf16 cast may round the bound up by half an ulp
    assert qkv.abs().max() <= b * ulp and qkv.abs().max() > 0.95 * b and abs(qkv.std() / (b / math.sqrt(3)) - 1) < 0.03
    c_fc = P["mlp"][:, 0].float()
    assert (P["mlp"][:, 1] == 0).all()
    assert c_fc.abs().max() <= b / 2 * ulp and c_fc.abs().max() > 0.95 * b / 2
    assert abs(P["lm_head"].float().std() / 0.005 - 1) < 0.03 and abs(P["lm_head"].float().mean()) < 2e-4
    assert torch.equal(P["embed"], P["lm_head"].T)
    for name in ("ve0", "ve1", "ve2", "attn_gate_bank", "ve_gate_bank", "smear_gate", "skip_gate", "x0_lambdas"):
        assert (P[name] == 0).all(), name
    s = P["scalars"].tolist()
    assert s[:L] == [pytest.approx(1.1)] * L
    assert s[L: 3 * L] == [0.5, 1.0] * L
    assert s[3 * L:] == [0.0, 0.5, -1.5]
    # seedable from outside
    torch.manual_seed(123)
    again = tg.GPT(cfg, torch.device("cpu"), CPU_OPS)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


@pytest.mark.parametrize("slices,per,multiple,pad", [(10, 4, 8, 0), (11, 4, 8, 1), (11, 2, 8, 1), (6, 2, 8, 2),
                                                     (5, 4, 8, 1), (3, 2, 16, 5), (7, 4, 8, 1), (12, 2, 8, 0)])
def test_bank_padding_is_the_fewest_slices_that_make_a_multiple(slices, per, multiple, pad):
    assert tg.bank_padding(slices, per, multiple) == pad
    assert (slices + pad) * per % multiple == 0
    assert all((slices + p) * per % multiple for p in range(pad))


def test_an_added_attention_layer_shards_on_eight_ranks():
    hp = tg.parse_args(["--attn_layout=PNPNNPNNNPN"])                 # 11 attention layers instead of 10
    model = tg.build_model(hp, torch.device("meta"), "sdpa")
    assert model.attn.shape[0] == 12 and model.mlp.shape[0] == 12      # 48 and 24 matrices
    for world_size in (1, 2, 4, 8):
        tg.build_optimizer(hp, model, world_size - 1, world_size)      # shards evenly: no error


def test_config_validation_names_the_option():
    with pytest.raises(ValueError, match="attn_layout"):
        tg.GPT(tiny_cfg(attn_layout="PNN-N"), torch.device("cpu"), CPU_OPS)
    with pytest.raises(ValueError, match="ve_layout"):
        tg.GPT(tiny_cfg(ve_layout=(1, 2, -1, 0, 0, 2)), torch.device("cpu"), CPU_OPS)  # VE on the attention-free layer
    with pytest.raises(ValueError, match="num_heads"):
        tg.GPT(tiny_cfg(num_heads=3), torch.device("cpu"), CPU_OPS)


# ---- attention paths ---------------------------------------------------------------------------------------------

def _layer_inputs(model, layer, T, seed=5):
    g = torch.Generator().manual_seed(seed)
    u = f32_rms(torch.randn(T, model.cfg.model_dim, generator=g)).bfloat16()
    j = model.cfg.ve_layout[layer]
    ve = (0.5 * torch.randn(T, model.cfg.model_dim, generator=g)).bfloat16() if j >= 0 else None
    return u, ve


def _model_attention(model, layer, u, ve, cu, window):
    p = model.plan[layer]
    L = model.cfg.num_layers
    sa = model.scalars[L:3 * L].view(L, 2)[layer]
    with torch.no_grad():
        return model.attention(p, model.attn[p.attn_slot], u, ve, sa, cu, 64, window)


@pytest.mark.parametrize("layer, ve_layout", [(0, (1, 2, -1, -1, 0, 2)), (5, (1, 2, -1, -1, 0, -1))])
def test_paired_attention_matches_direct(layer, ve_layout):  # with a value embedding (layer 0) and without (5)
    torch.manual_seed(0)
    model = tg.GPT(tiny_cfg(ve_layout=ve_layout), torch.device("cpu"), CPU_OPS)
    randomize(model)
    model.attn_scale = 0.3
    T, window = 32, 12   # window in doubled positions (6 tokens)
    _, _, cu = batch(T=T, docs=(0, 13, 27))
    u, ve = _layer_inputs(model, layer, T)
    got = _model_attention(model, layer, u, ve, cu, window)
    want = attention_direct(model, layer, u, ve, cu, window)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert rel_err(got, want) < 0.02
    # the check is sensitive to the swapped slot-1 angle rule
    assert rel_err(got, attention_direct(model, layer, u, ve, cu, window, swap_slot=False)) > 0.05


@pytest.mark.parametrize("layer", [1, 2, 4])  # 1: long window + key offset + VE; 2: plain; 4: long + offset + VE0
def test_normal_attention_matches_direct(layer):
    torch.manual_seed(0)
    model = tg.GPT(tiny_cfg(), torch.device("cpu"), CPU_OPS)
    randomize(model, seed=layer)
    model.attn_scale = 0.3
    T, window = 40, 10
    _, _, cu = batch(T=T, docs=(0, 7, 30))
    u, ve = _layer_inputs(model, layer, T, seed=layer)
    got = _model_attention(model, layer, u, ve, cu, window)
    want = attention_direct(model, layer, u, ve, cu, window)
    assert rel_err(got, want) < 0.02


def test_key_offset_shift_is_one_position_on_the_second_quarters():
    k = torch.randn(5, 2, 16)
    out = tk.shift_keys_by_one(k)
    assert torch.equal(out[0], k[0])
    for t in range(1, 5):
        for d in range(16):
            src = t - 1 if (4 <= d < 8 or 12 <= d < 16) else t
            assert torch.equal(out[t, :, d], k[src, :, d])


# ---- rotary / YaRN -----------------------------------------------------------------------------------------------

def test_yarn_schedule_values_and_frequencies():
    cfg = tiny_cfg(model_dim=128, num_heads=1, head_dim=128, num_layers=2, attn_layout="NN", ve_layout=(-1, -1),
                   num_value_embeds=0, long_window_layers=(1,), skip_source_layer=0, skip_dest_layer=1,
                   backout_layer=1, block_size=128, vocab_size=32, rotary_max_len=64)
    model = tg.GPT(cfg, torch.device("cpu"), CPU_OPS)
    omega0 = model.rotary_omega.clone()
    f = omega_direct(128, 1024.0)
    assert torch.allclose(omega0[:64:2].double(), f, rtol=1e-6) and torch.equal(omega0[:64:2], omega0[1:64:2])
    assert (omega0[64:] == 0).all()
    scales = [model.attn_scale]
    expected_omega = f.clone()
    for a, b in ((3, 7), (7, 11), (11, 13)):
        model.apply_yarn(a, b)
        scales.append(model.attn_scale)
        rot = 128 * a * expected_omega / (2 * math.pi)
        ramp = ((rot - 1) / 31).clamp(0, 1)
        expected_omega = expected_omega * (a / b + ramp * (1 - a / b))
    assert scales == pytest.approx([0.1, 0.11694596, 0.12751752, 0.13177799], abs=5e-9)
    omega = model.rotary_omega
    assert torch.allclose(omega[:64:2].double(), expected_omega, rtol=1e-5)
    assert torch.equal(omega[:6], omega0[:6])                       # j = 0, 1, 2 untouched
    assert omega[62].item() / omega0[62].item() == pytest.approx(3 / 13, rel=1e-6)
    assert omega[50].item() / omega0[50].item() == pytest.approx(3 / 13, rel=1e-6)
    assert (omega[64:] == 0).all()
    # tables follow omega: row p, column c = bf16(cos(p w_c)), sin negated on odd columns
    p = torch.arange(2 * 64, dtype=torch.float32)[:, None]
    theta = p * omega[None, :64]
    assert torch.equal(model.rotary_cos, theta.cos().bfloat16())
    sign = torch.tensor([1.0, -1.0]).repeat(32)
    assert torch.equal(model.rotary_sin, (theta.sin() * sign).bfloat16())
    model.reset_rotary()
    assert model.attn_scale == 0.1 and torch.equal(model.rotary_omega, omega0)
    assert torch.equal(model.rotary_cos, (p * omega0[None, :64]).cos().bfloat16())


# ---- losses and backward ------------------------------------------------------------------------------------------

def test_full_forward_matches_direct_train_and_eval():
    torch.manual_seed(0)
    model = tg.GPT(tiny_cfg(), torch.device("cpu"), CPU_OPS)
    randomize(model, seed=3)
    inputs, targets, cu = batch(T=48, docs=(0, 17, 40))
    weights = torch.tensor([1.0, 0.5, 0.25])
    with torch.no_grad():
        h_ref = hidden_direct(model, inputs, cu, ws_short=1, ws_long=2)
        h = model.final_hidden(inputs, cu, 1, 2, 64)
        assert rel_err(h, h_ref) < 0.03
        train_loss = model(inputs, targets, cu, 1, 2, weights, 64)
        # the loss is exactly the sum of MTP rows of the model's own logits (record 80's bf16 sigma) ...
        own = mtp_train_loss_direct(h @ model.lm_head, targets, weights)
        assert train_loss.dtype == torch.float32 and train_loss.item() == pytest.approx(own, rel=1e-5)
        # ... which is not the loss of the unrounded sigma (the rounding moves it by ~1e-4 here) ...
        assert abs(train_loss.item() - mtp_loss_direct(h @ model.lm_head, targets, weights)) > 1e-5 * own
        # ... and close to the fp32 reference of the whole model
        ref_logits = h_ref @ model.lm_head.float()
        assert train_loss.item() == pytest.approx(mtp_train_loss_direct(ref_logits.bfloat16(), targets, weights),
                                                  rel=0.01)
        # zero weights and rows past the end are dropped, not renormalised
        w2 = torch.tensor([1.0, 0.0, 0.7])
        assert model(inputs, targets, cu, 1, 2, w2, 64).item() == pytest.approx(
            mtp_train_loss_direct(h @ model.lm_head, targets, w2), rel=1e-5)
        model.eval()
        eval_loss = model(inputs, targets, cu, 1, 2, weights, 64)
        z = softcap(h @ model.lm_head)
        mean_ce = (torch.logsumexp(z, -1) - z.gather(1, targets[:, None])[:, 0]).mean()
        assert eval_loss.item() == pytest.approx(mean_ce.item(), rel=1e-5)  # softcap in fp32 (compiled semantics)
        z_ref = softcap(ref_logits)
        assert eval_loss.item() == pytest.approx(
            (torch.logsumexp(z_ref, -1) - z_ref.gather(1, targets[:, None])[:, 0]).mean().item(), rel=0.01)


@pytest.mark.parametrize("use_fp8", [False, True])
def test_backward_gives_finite_grads_for_every_label(use_fp8):
    torch.manual_seed(0)
    model = tg.GPT(tiny_cfg(use_fp8=use_fp8), torch.device("cpu"), CPU_OPS)
    randomize(model, seed=7)
    inputs, targets, cu = batch(T=48, docs=(0, 30))
    loss = model(inputs, targets, cu, 1, 3, torch.tensor([1.0, 0.5]), 64)
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in dict(model.named_parameters()).items():
        assert p.grad is not None and p.grad.dtype == p.dtype, name
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    # the MLP pad slices are never read
    assert (model.mlp.grad[model.cfg.num_layers:] == 0).all()


def test_forward_traces_as_one_graph():
    """Dynamo (fullgraph, static shapes) must trace train and eval forward without graph breaks."""
    torch._dynamo.reset()
    model = tg.GPT(tiny_cfg(use_fp8=True), torch.device("cpu"), CPU_OPS)
    randomize(model)
    inputs, targets, cu = batch(T=32, docs=(0, 9))
    compiled = torch.compile(model, backend="eager", fullgraph=True, dynamic=False)
    w = torch.tensor([1.0, 0.5, 0.25])
    loss = compiled(inputs, targets, cu, 1, 3, w, 64)
    loss.backward()
    assert loss.item() == pytest.approx(model(inputs, targets, cu, 1, 3, w, 64).item(), rel=1e-3)
    model.eval()
    with torch.no_grad():
        assert torch.isfinite(compiled(inputs, targets, cu, 1, 3, w, 64))


# ---- FP8 head emulation -------------------------------------------------------------------------------------------

def test_fp8_saturating_casts_hand_values():
    e4m3 = tg.fp8_quantize(torch.tensor([1.0625, 1.1875, 460.0, -1e6, 448.0, 0.5]), 1.0, torch.float8_e4m3fn)
    assert e4m3.float().tolist() == [1.0, 1.25, 448.0, -448.0, 448.0, 0.5]      # RNE ties to even, saturation
    e5m2 = tg.fp8_quantize(torch.tensor([3.0, 60000.0, -1e9, 1.125]), 1.0, torch.float8_e5m2)
    assert e5m2.float().tolist() == [3.0, 57344.0, -57344.0, 1.0]
    # division by the scale happens in fp32 before the cast: 1.0 / 0.25 = 4 exactly
    assert tg.fp8_quantize(torch.tensor([1.0], dtype=torch.bfloat16), 0.25, torch.float8_e4m3fn).item() == 4.0


def test_fp8_quantize_every_bf16_value_against_a_float64_transcription():
    """All 65,280 finite bf16 values at the three scales: x * fp32(1/s), rounded once to fp32 (the float64 product of a
    bf16 and an fp32 value is exact, so rounding it to fp32 gives the correctly rounded fp32 product), clamped, cast
    with round-to-nearest-even. That is what torch.compile makes of the reference's x / s with a constant s, and what
    the fused CE backward computes. The IEEE division x / s gives the same FP8 values for every one of these inputs
    (the fp32 quotients differ in the last bit for some, never across an FP8 rounding boundary), so writing the
    quantiser as a product changed no result."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = x[torch.isfinite(x)]
    for s, dtype in ((0.75 / 448, torch.float8_e5m2), (100 / 448, torch.float8_e4m3fn),
                     (1.6 / 448, torch.float8_e4m3fn)):
        lim = torch.finfo(dtype).max
        inv32 = float(torch.tensor(1 / s, dtype=torch.float32))
        want = (x.double() * inv32).float().clamp(-lim, lim).to(dtype).view(torch.uint8)
        got = tg.fp8_quantize(x, s, dtype).view(torch.uint8)
        assert torch.equal(got, want), (s, int((got != want).sum()))
        by_division = (x.float() / s).clamp(-lim, lim).to(dtype).view(torch.uint8)
        assert torch.equal(got, by_division), (s, int((got != by_division).sum()))


def _manual_q(x, s, dtype, lim):
    return torch.clamp(x.float() / s, -lim, lim).to(dtype).float()


def test_fp8_emulation_forward_backward_vs_manual():
    s_x, s_w, s_g = 100 / 448, 1.6 / 448, 0.75 / 448
    g = torch.Generator().manual_seed(0)
    h = torch.randn(32, 64, generator=g).bfloat16()
    w = (0.005 * torch.randn(64, 48, generator=g)).bfloat16()
    h[0, 0], w[1, 2] = 1000.0, -10.0                       # both overflow e4m3 after scaling
    logits, x8_t, w8 = tg.fp8_head_emulated(h, w, s_x, s_w)
    x8, w8_manual = _manual_q(h, s_x, torch.float8_e4m3fn, 448), _manual_q(w, s_w, torch.float8_e4m3fn, 448)
    assert x8[0, 0] == 448 and w8_manual[1, 2] == -448
    assert torch.equal(x8_t.float(), x8.T) and torch.equal(w8.float(), w8_manual)
    sxw = torch.tensor(s_x) * torch.tensor(s_w)
    want = (x8.double() @ w8_manual.double() * sxw.double())
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    assert torch.allclose(logits.double(), want, rtol=8e-3, atol=1e-6)
    g8 = (1e3 * torch.randn(32, 48, generator=g)).clamp(-57344, 57344).to(torch.float8_e5m2)
    dh, dw = tg.fp8_head_backward_emulated(g8, g8.t().contiguous(), x8_t, w8, s_x, s_w, s_g)
    want_dh = g8.double() @ w8_manual.double().T * (s_g * s_w)
    want_dw = x8.double().T @ g8.double() * (s_x * s_g)
    assert dh.dtype == torch.bfloat16 and dw.dtype == torch.float32
    assert torch.allclose(dh.double(), want_dh, rtol=8e-3, atol=1e-9)
    assert torch.allclose(dw.double(), want_dw, rtol=1e-5, atol=1e-9)


def test_fp8_custom_ops_match_the_emulation_on_cpu():
    """The two custom ops (eager quantisers off CUDA) against the emulation's forward and backward, and their fake
    kernels. Skipped where torch._scaled_mm has no CPU kernel."""
    tg.register_fp8_head_op()
    tg.register_fp8_head_op()  # idempotent
    s_x, s_w, s_g = 100 / 448, 1.6 / 448, 0.75 / 448
    g = torch.Generator().manual_seed(1)
    h = torch.randn(32, 64, generator=g).bfloat16()
    w = (0.005 * torch.randn(64, 48, generator=g)).bfloat16()
    g8 = (1e3 * torch.randn(32, 48, generator=g)).clamp(-57344, 57344).to(torch.float8_e5m2)
    g8_t = g8.t().contiguous()
    try:
        out, x8_t, w8 = torch.ops.nanogpt.fp8_head(h, w, s_x, s_w)
    except (RuntimeError, NotImplementedError) as err:
        pytest.skip(f"torch._scaled_mm unavailable on CPU here: {err}")
    assert out.dtype == torch.bfloat16 and x8_t.shape == (64, 32) and w8.shape == (64, 48)
    assert torch.equal(x8_t.float(), tg.fp8_quantize(h, s_x, torch.float8_e4m3fn).float().T)
    dh, dw = torch.ops.nanogpt.fp8_head_backward(g8, g8_t, x8_t, w8, s_x, s_w, s_g)
    assert dh.dtype == torch.bfloat16 and dw.dtype == torch.float32
    for op, args in ((torch.ops.nanogpt.fp8_head.default, (h, w, s_x, s_w)),
                     (torch.ops.nanogpt.fp8_head_backward.default, (g8, g8_t, x8_t, w8, s_x, s_w, s_g))):
        assert torch.library.opcheck(op, args, test_utils=("test_faketensor",))["test_faketensor"] == "SUCCESS"

    ref, ref_x8_t, ref_w8 = tg.fp8_head_emulated(h, w, s_x, s_w)
    assert torch.equal(ref_x8_t.float(), x8_t.float()) and torch.equal(ref_w8.float(), w8.float())
    ref_dh, ref_dw = tg.fp8_head_backward_emulated(g8, g8_t, ref_x8_t, ref_w8, s_x, s_w, s_g)
    # same quantised operands, fp32 accumulation both ways: only the accumulation order and output rounding differ
    assert torch.allclose(out.float(), ref.float(), rtol=1e-2, atol=1e-6)
    assert torch.allclose(dh.float(), ref_dh.float(), rtol=1e-2, atol=1e-9)
    assert torch.allclose(dw, ref_dw, rtol=1e-2, atol=1e-9)


# ---- the training head: FP8 head + record 80's loss, gradient formed in the forward -------------------------------

FP8_SCALES = (100 / 448, 1.6 / 448, 0.75 / 448)


def _head_case(seed=4, T=40, D=64, V=96):
    g = torch.Generator().manual_seed(seed)
    h = tg.rms(torch.randn(T, D, generator=g)).bfloat16().requires_grad_(True)
    w = (0.3 * torch.randn(D, V, generator=g)).bfloat16().requires_grad_(True)
    return h, w, torch.randint(0, V, (T,), generator=g)


@pytest.mark.parametrize("weights", [[1.0, 0.5, 0.25], [1.0, 0.5], [1.0]])
@pytest.mark.parametrize("grad_scale", [1.0, 0.25])
def test_fp8_training_head_backward_is_the_spec_gradient(weights, grad_scale):
    """The CPU training op (emulated head, reference loss): losses = the float64 transcription of the bf16 logits;
    dh and dW = the FP8 backward of G8 = e5m2(g) with g the spec's fp32 gradient of grad_scale * sum(losses)
    (tail rule on the last K-1 rows), s_g = grad_scale * 0.75/448."""
    import _ce_spec as spec
    h, w, targets = _head_case()
    mtp = torch.tensor(weights)
    s_x, s_w, s_g8 = FP8_SCALES
    losses = CPU_OPS.fp8_head_mtp_ce(h, w, targets, mtp, grad_scale, *FP8_SCALES)
    dh, dw = torch.autograd.grad(losses.sum() * grad_scale, (h, w))
    logits, x8_t, w8 = tg.fp8_head_emulated(h.detach(), w.detach(), s_x, s_w)
    want = spec.ce_train_spec(logits, targets, weights)
    torch.testing.assert_close(losses.double(), want["losses"], rtol=1e-5, atol=1e-5)
    s_g = grad_scale * s_g8
    g32 = spec.g_fp32(want, spec.fp8_grad_factor(grad_scale, s_g))
    g8 = spec.round_e5m2(g32)
    want_dh, want_dw = tg.fp8_head_backward_emulated(g8.float().to(torch.float8_e5m2), None, x8_t, w8, s_x, s_w,
                                                     s_g)
    loose = spec.ambiguous(g32, spec.round_e5m2, 3e-5).any(1)       # rows that may legally differ by an e5m2 step
    assert loose.float().mean() < 0.2
    assert torch.equal(dh[~loose], want_dh[~loose])
    torch.testing.assert_close(dw.float(), want_dw, rtol=2e-2, atol=1e-3 * want_dw.abs().max().item())
    assert dh.dtype == dw.dtype == torch.bfloat16


def test_fp8_training_head_checks_the_incoming_gradient_on_cpu():
    """The op forms the gradient of grad_scale * sum(losses) in the forward and ignores the incoming one (F4); on a
    CPU a backward of anything else is an error naming the fix, and the right one passes. grad_scale changes only
    s_g: G8 is the same, so the gradients scale by it exactly."""
    h, w, targets = _head_case(seed=5)
    mtp = torch.tensor([1.0, 0.5, 0.25])
    losses = CPU_OPS.fp8_head_mtp_ce(h, w, targets, mtp, 0.5, *FP8_SCALES)
    with pytest.raises(RuntimeError, match=r"grad_scale=0.5.*\(loss \* 0.5\).backward\(\)"):
        losses.sum().backward(retain_graph=True)
    half = torch.autograd.grad(losses.sum() * 0.5, (h, w))
    one = torch.autograd.grad(CPU_OPS.fp8_head_mtp_ce(h, w, targets, mtp, 1.0, *FP8_SCALES).sum(), (h, w))
    for a, b in zip(half, one):
        assert torch.equal(2 * a, b)


def test_fp8_training_head_forms_the_gradient_in_the_forward():
    """What the backward needs is G8 (e5m2) in both layouts, X8^T and W8: not the logits."""
    h, w, targets = _head_case(seed=6)
    losses = CPU_OPS.fp8_head_mtp_ce(h, w, targets, torch.tensor([1.0, 0.5]), 1.0, *FP8_SCALES)
    saved = losses.grad_fn.saved_tensors
    assert [t.dtype for t in saved] == [torch.float8_e5m2] * 2 + [torch.float8_e4m3fn] * 2
    assert saved[0].shape == (40, 96) and saved[1].shape == (96, 40) and torch.equal(saved[1].float(),
                                                                                    saved[0].float().T)


def test_training_loss_without_fp8_passes_the_gradient_through():
    """use_fp8=False: the loss of record 80 (bf16 sigma for bf16 logits) with its gradient formula, scaled by the
    incoming gradient per row (no F4 contract on this path)."""
    import _ce_spec as spec
    g = torch.Generator().manual_seed(9)
    logits = (4 * torch.randn(12, 50, generator=g)).bfloat16().requires_grad_(True)
    targets = torch.randint(0, 50, (12,), generator=g)
    weights = [1.0, 0.5, 0.25]
    losses = CPU_OPS.mtp_ce_train(logits, targets, torch.tensor(weights))
    want = spec.ce_train_spec(logits.detach(), targets, weights)
    torch.testing.assert_close(losses.double(), want["losses"], rtol=1e-5, atol=1e-5)
    grad_rows = torch.rand(12, generator=g) + 0.5
    (d,) = torch.autograd.grad(losses, logits, grad_rows)
    want_d = (grad_rows.double()[:, None] * spec.INV_C_A) * want["delta"] * want["s"] * (1 - want["s"])
    assert d.dtype == torch.bfloat16
    torch.testing.assert_close(d.double(), want_d, rtol=2 ** -7, atol=1e-6 * want_d.abs().max().item())


# ---- --kernels=torch ----------------------------------------------------------------------------------------------

def _kernels_loss(kernels: str, train: bool = True) -> tuple[tg.GPT, torch.Tensor]:
    torch.manual_seed(0)
    model = tg.GPT(tiny_cfg(use_fp8=True), torch.device("cpu"), tg.kernel_ops(kernels, "cpu"))
    randomize(model, seed=7)
    model.train(train)
    inputs, targets, cu = batch(T=48, docs=(0, 30))
    weights = torch.tensor([1.0, 0.5, 0.25] if train else [1.0])
    return model, model(inputs, targets, cu, 1, 3, weights, 64)


def test_kernels_torch_gives_the_fused_numbers_on_cpu():
    # On a CPU every op runs its reference, whatever --kernels asks.
    fused_model, fused = _kernels_loss("fused")
    torch_model, plain = _kernels_loss("torch")
    assert plain.item() == pytest.approx(fused.item(), rel=1e-5)
    fused.backward()
    plain.backward()
    for (name, a), b in zip(fused_model.named_parameters(), torch_model.parameters()):
        assert (a.grad.float() - b.grad.float()).norm() <= 1e-2 * a.grad.float().norm(), name
    assert _kernels_loss("torch", train=False)[1].item() == pytest.approx(_kernels_loss("fused", train=False)[1].item(),
                                                                           rel=1e-5)


def test_kernels_torch_runs_the_edited_definitions(monkeypatch):
    _, plain = _kernels_loss("torch")
    calls = []

    def relu_mlp(x, c_fc, c_proj):          # an edited activation: ReLU instead of ReLU^2
        calls.append(x.shape)
        return F.relu(x @ c_fc.mT) @ c_proj

    monkeypatch.setattr(tg.tk, "relu2_mlp_reference", relu_mlp)
    _, edited = _kernels_loss("torch")
    assert len(calls) == 6 and abs(edited.item() - plain.item()) > 1e-3 * abs(plain.item())
    reference_loss = tg.tk.softcapped_mtp_ce_fp8_reference

    def doubled_loss(*args):                # an edited training loss: twice the losses
        losses, g8, g8_t = reference_loss(*args)
        return 2 * losses, g8, g8_t
    monkeypatch.setattr(tg.tk, "softcapped_mtp_ce_fp8_reference", doubled_loss)
    _, doubled = _kernels_loss("torch")
    assert doubled.item() == pytest.approx(2 * edited.item(), rel=1e-6)
