"""CPU tests of the MODEL section of train_gpt.py against direct implementations written here.

The attention backend is replaced by `masked_sdpa`, a dense-mask stand-in defined in this file (the real
varlen_attention lives in another section). The last layer's DC correction is the op table's (its reference here,
recorded by `recording_dc`; its kernels are tested in test_dc.py) against `dc_direct`, a per-token transcription:
what is checked here is that the right tensors reach it, at the right point of the attention sublayer. The references transcribe record 89's
model (the bigram hash and sign index, the banks' layout, the layer plan, the per-token MUDD gates and their column
layout, attention with per-token XSA and output gates, MUDD, the forward pass, the losses) in float64 with loops over
tokens and heads where the math is a per-token rule, reading nothing from train_gpt but the parameters and the rotary
tables (tested on their own in test_yarn_schedule_values_and_frequencies). The model runs in float64 (--dtype=float64)
against them with tight tolerances, and in bf16 with loose ones.

The parameters are the model's own (named_parameters) and their rows DEFAULT_PARAM_TABLE's: a test names a parameter
only to check something about it. A parameter the references do not know (a new idea's) keeps its initial value in
`randomize`: an idea that starts as the identity leaves every reference here valid.
"""
import dataclasses
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import train_gpt as tg
import triton_kernels as tk

EPS = 2.0 ** -23
CPU_OPS = tg.kernel_ops("fused", "cpu")   # off CUDA every op is its reference


@dataclasses.dataclass
class TinyOptions(tg.Hyperparameters):
    """The model options of a small test model, plus the two sizes GPT derives from the batches when not given."""
    rotary_max_len: int = 128
    bank_multiple: int = 0          # 0: derived (8 for batch_slices 8)


def tiny_cfg(**overrides) -> TinyOptions:
    cfg = TinyOptions(
        vocab_size=256, model_dim=64, num_heads=4, head_dim=16, mlp_hidden=128, num_layers=6, num_value_embeds=4,
        bigram_vocab_size=97, bigram_sign_rows=32, attn_layout="PNN-PN", long_window_layers=(1, 5),
        ve_layout=(-1, 0, 1, -1, 2, 3), skip_source_layer=1, skip_dest_layer=3, cached_input_layer=3, mudd_hidden=8,
        mudd_gate_hidden=8, dc_window=5,
        block_size=16, rope_base=1024.0, attn_scale=0.1, yarn_alpha=1.0, yarn_beta=32.0,
        fp8_scales=(100 / 448, 1.6 / 448, 0.75 / 448), use_fp8=False, fp8_mlp=False, attn_backend="test-sdpa")
    return replace(cfg, **overrides)


def GPT(cfg: TinyOptions, device: torch.device, ops) -> tg.GPT:
    """tg.GPT of the test options, with their backend name and sizes."""
    return tg.GPT(cfg, device, ops, cfg.attn_backend, cfg.rotary_max_len, cfg.bank_multiple or None)


def record_model() -> tg.GPT:
    """The record's model at full size (the default Hyperparameters), on the meta device: shapes, no values."""
    return tg.build_model(tg.Hyperparameters(), torch.device("meta"), "sdpa")


def masked_sdpa(q, k, v, cu_seqlens, max_seqlen, window, scale, backend):
    """Stand-in for varlen_attention: dense mask (same document, causal, key >= query - window), softmax in fp32
    (float64 for a float64 model)."""
    assert backend == "test-sdpa" and q.dtype in (torch.bfloat16, torch.float64) and q.shape == k.shape == v.shape
    T = q.shape[0]
    if not torch.compiler.is_compiling():
        assert int(cu_seqlens[-1]) == T and max_seqlen >= int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    acc = tk.acc_dtype(q.dtype)
    pos = torch.arange(T)
    doc = torch.searchsorted(cu_seqlens.long(), pos, right=True)
    mask = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None]) & (pos[None, :] >= pos[:, None] - window)
    scores = torch.einsum("thd,shd->hts", q.to(acc), k.to(acc)) * scale
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", probs, v.to(acc)).to(q.dtype)


DC_CALLS = []   # (window, scale, cu_seqlens) of each call of the model's DC correction
REAL_DC_CORRECTION = CPU_OPS.dc_correction    # the op table's: the reference off CUDA


def recording_dc(y, q, k, v, w1, w2, cu_seqlens, scale, window):
    """The op table's DC correction, recording what the model passes it (the window, the scale, the documents)."""
    assert q.shape == k.shape == v.shape == y.shape and w1.shape == w2.shape == y.shape[:2]
    if not torch.compiler.is_compiling():
        DC_CALLS.append((window, scale, cu_seqlens.clone()))
    return REAL_DC_CORRECTION(y, q, k, v, w1, w2, cu_seqlens, scale, window)


CPU_OPS = dataclasses.replace(CPU_OPS, dc_correction=recording_dc)


def dc_direct(q, k, v, y, w1, w2, cu, scale, window):
    """The DC correction per token and head in float64: y + sum over the `window` latest keys s of t's document of
    w2_h (sum_h' w1_h' P_h'(t, s)) v_s, P_h the softmax of scale <q_t, k_s> over those keys."""
    T, H, _ = q.shape
    q, k, v, w1, w2 = (x.double() for x in (q, k, v, w1, w2))
    out = y.double().clone()
    for t in range(T):
        keys = [s for s in range(T) if t - window < s <= t and doc_of(cu, s) == doc_of(cu, t)]
        probs = torch.stack([torch.stack([scale * (q[t, h] @ k[s, h]) for s in keys]).softmax(0) for h in range(H)])
        mixed = w1[t] @ probs                                                          # (len(keys),)
        for h in range(H):
            out[t, h] += w2[t, h] * (mixed @ v[keys, h])
    return out


@pytest.fixture(autouse=True)
def _standin_attention(monkeypatch):
    monkeypatch.setattr(tg, "varlen_attention", masked_sdpa, raising=False)
    DC_CALLS.clear()


GATES = ("smear_gate", "ve_gate_bank")


def randomize(model: tg.GPT, seed: int = 0) -> None:
    """Non-zero values in every parameter the references read, lambdas and gates away from their init, so that every
    term of the forward matters (the zero-initialised tables and gates would hide whole paths). Any other parameter
    keeps its initial value."""
    g = torch.Generator().manual_seed(seed)
    L = model.hp.num_layers
    with torch.no_grad():
        for name, p in dict(model.named_parameters()).items():
            r = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if name == "scalars":
                base = torch.cat([torch.tensor([0.5, 1.0]).repeat(L), torch.tensor([0.3, -1.5])])
                p.copy_(base + 0.1 * r)
            elif name in ("mudd_w1", "mudd_gate_w1"):
                p.copy_(r * p.shape[-1] ** -0.5)
            elif name in ("mudd_w2", "mudd_gate_w2"):
                p.copy_(2 * r * p.shape[-1] ** -0.5)
            elif name in ("mudd_b2", "mudd_gate_b2"):
                p.add_(r)
            elif name == "mudd_gate_scale":
                p.copy_(0.1 + 0.02 * r)
            elif name in ("resid_lambdas", "post_lambdas"):
                p.copy_(1.0 + 0.2 * r)
            elif name in ("lm_head", "embed", "value_embeds", "bigram_embed") + GATES:
                p.copy_(0.5 * r)
            elif name in ("qk", "vo", "mlp"):
                p.copy_(r * p.shape[-1] ** -0.5)
    model.refresh_fp8_down(None)   # the FP8 down weights of the new bank, as after an optimizer step


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


def rotate_direct(vec, cos_row, sin_row):
    """Clockwise rotation of pairs (2m, 2m+1) of the first half by the angle whose cosine and sine are the tables'
    columns 2m (the table negates sin on odd columns; its even column holds +sin); the second half untouched."""
    out = vec.clone()
    for m in range(cos_row.shape[0] // 2):
        c, s = cos_row[2 * m].item(), sin_row[2 * m].item()
        a, b = vec[2 * m].item(), vec[2 * m + 1].item()
        out[2 * m] = c * a + s * b
        out[2 * m + 1] = c * b - s * a
    return out


def doc_of(cu, t):
    cu = cu.tolist()
    return max(j for j in range(len(cu) - 1) if cu[j] <= t < cu[j + 1])


def as_model_dtype(model, x):
    """x rounded to the model's weight dtype (bf16; nothing for a float64 model), back in float64."""
    return x.to(model.embed.dtype).double()


def bigram_direct(ids, table_size):
    """The bigram hash in Python integers: b_0 = p_0 = M, p_t = x_t, b_t = floormod(i32(36313 x_t) ^ i32(27191 p_{t-1}),
    M) with i32 the two's complement wrap."""
    M = table_size - 1

    def i32(v):
        v &= 0xFFFFFFFF
        return v - (1 << 32) if v >= (1 << 31) else v
    out, prev = [M][:len(ids)], M
    for t in range(1, len(ids)):
        out.append((i32(36313 * ids[t]) ^ i32(27191 * prev)) % M)
        prev = ids[t]
    return out


def layer_weights(model, layer):
    """A layer's attention weights assembled from the banks, written out: W_q rows of heads (2j, 2j+1) = qk[H*l + j],
    W_k's = qk[H*l + H/2 + j], W_v = vo[2l], W_o = vo[2l + 1] (float64)."""
    cfg = model.hp
    H = cfg.num_heads
    l = sum(c != "-" for c in cfg.attn_layout[:layer])
    qk, vo = model.qk.detach().double(), model.vo.detach().double()
    Wq = torch.cat([qk[H * l + j] for j in range(H // 2)])
    Wk = torch.cat([qk[H * l + H // 2 + j] for j in range(H // 2)])
    return Wq, Wk, vo[2 * l], vo[2 * l + 1]


def attention_direct(model, layer, u, ve, cu, window, *, mudd=None, xsa=None, out_gate=None, dc=None,
                     swap_slot=True, key_offset_dims=None):
    """The attention sublayer (paired and normal) written out per token and head, in float64 from the model's
    weights (the lambda-scaled weights rounded to the model's dtype). u (T, D) -> (T, D) float64. mudd: (gate (T, H),
    mix (T, D)) of the MUDD layer, in place of the VE gate. Then on FA's output, each where given (raw gate columns,
    (T, H) each): dc = (raw w1, w2), the DC correction (dc_direct on w1 normalised over the heads); xsa = alpha, y -
    bf16(tanh alpha) <y, v> / max(|v|^2, 1e-8) v; out_gate, a factor per token and head (no sigmoid).
    key_offset_dims: the dims the key offset moves (default the stationary half: the head's second half, which rotary
    leaves unrotated)."""
    cfg = model.hp
    T, D, H, hd = u.shape[0], cfg.model_dim, cfg.num_heads, cfg.head_dim
    kind = cfg.attn_layout[layer]
    ve_slot = sum(j >= 0 for j in cfg.ve_layout[:layer])
    sc = model.scalars.detach().double()
    lam_qkv, lam_o = sc[2 * layer], sc[2 * layer + 1]
    Wq, Wk, Wv, Wo = layer_weights(model, layer)
    Wqkv = as_model_dtype(model, lam_qkv * torch.cat([Wq, Wk, Wv]))
    Wo = as_model_dtype(model, lam_o * Wo)
    uf = u.double()
    qkv = uf @ Wqkv.T
    q = f32_rms(qkv[:, :D].view(T, H, hd))
    k = f32_rms(qkv[:, D: 2 * D].view(T, H, hd))
    v = qkv[:, 2 * D:].view(T, H, hd).clone()
    cos, sin = model.rotary_cos.double(), model.rotary_sin.double()
    qr, kr = torch.empty_like(q), torch.empty_like(k)
    for t in range(T):
        for h in range(H):
            if kind == "P":
                angle = 2 * t + (h % 2 if swap_slot else int(h >= H // 2))
            else:
                angle = t
            qr[t, h] = rotate_direct(q[t, h], cos[angle], sin[angle])
            kr[t, h] = rotate_direct(k[t, h], cos[angle], sin[angle])
    if kind == "N" and layer in cfg.long_window_layers:
        dims = key_offset_dims if key_offset_dims is not None else range(hd // 2, hd)
        shifted = kr.clone()
        for t in range(1, T):
            for d in dims:
                shifted[t, :, d] = kr[t - 1, :, d]
        kr = shifted
    if mudd is not None:
        gate, mix = mudd
        for t in range(T):
            for h in range(H):
                v[t, h] += gate[t, h] * ve.double()[t, h * hd:(h + 1) * hd] + mix[t, h * hd:(h + 1) * hd]
    elif ve is not None:
        Gv = model.ve_gate_bank[ve_slot].detach().double()
        ve = ve.double()
        for t in range(T):
            # the value-embedding gate reads [u_0..u_5, ve_0..ve_5] on every layer
            gin = torch.cat([uf[t, :6], ve[t, :6]])
            for h in range(H):
                v[t, h] += 2 * torch.sigmoid(gin @ Gv[h]) * ve[t, h * hd:(h + 1) * hd]
    y = torch.zeros(T, H, hd, dtype=torch.float64)
    if kind == "P":
        # doubled position P = 2t (heads < H/2) or 2t+1 (heads >= H/2), slot g = h mod H/2
        n = 2 * T
        slots = H // 2
        Q, K, Vd = (torch.zeros(n, slots, hd, dtype=torch.float64) for _ in range(3))
        tok = [P // 2 for P in range(n)]
        for t in range(T):
            for h in range(H):
                P, g = 2 * t + int(h >= slots), h % slots
                Q[P, g], K[P, g], Vd[P, g] = qr[t, h], kr[t, h], v[t, h]
        Yd = torch.zeros(n, slots, hd, dtype=torch.float64)
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
    y = as_model_dtype(model, y)
    if dc is not None:
        y = as_model_dtype(model, dc_direct(qr, kr, v, y, dc_w1_direct(model, dc[0]), dc[1], cu, model.attn_scale,
                                            cfg.dc_window))
    if xsa is not None:   # minus tau times y's projection on its own value, the algebraic form (record 86)
        tau = as_model_dtype(model, torch.tanh(xsa.double()))
        for t in range(T):
            for h in range(H):
                along = (y[t, h] @ v[t, h]) / max((v[t, h] @ v[t, h]).item(), 1e-8)
                y[t, h] = y[t, h] - tau[t, h] * along * v[t, h]
        y = as_model_dtype(model, y)
    if out_gate is not None:
        for t in range(T):
            for h in range(H):
                y[t, h] = y[t, h] * out_gate[t, h]
    return y.reshape(T, D) @ Wo.T


def dc_w1_direct(model, raw):
    """DC's w1 from its raw gate columns (T, H): divided by the rms over the heads, eps 1e-6, no gain; rounded."""
    return as_model_dtype(model, raw.double() / torch.sqrt(raw.double().pow(2).mean(-1, keepdim=True) + 1e-6))


def gate_layout_direct(cfg):
    """The MUDD gates' output columns of record 85 from the layout options, written out: {(layer, kind): (gate,
    first column)} and the two widths. The pre gate (0) serves the layers up to the skip source, the post gate (1) the
    rest. Each lists, over its layers in order: the XSA strengths of the normal attention layers that read their own
    residual and are not the last (H each), the output gates of the long-window attention layers (H each), an x0 gate
    and a bigram gate for every layer with attention but the last and for layer 0, the skip gate of the skip
    destination, then DC's w1 (H) and w2 (H) of the last layer."""
    L, H = cfg.num_layers, cfg.num_heads
    gate = [0 if i <= cfg.skip_source_layer else 1 for i in range(L)]
    attn = [cfg.attn_layout[i] != "-" for i in range(L)]
    kinds = (("xsa", H, lambda i: cfg.attn_layout[i] == "N" and i <= cfg.cached_input_layer and i < L - 1),
             ("out", H, lambda i: attn[i] and i in cfg.long_window_layers),
             ("pair", 2, lambda i: (attn[i] or i == 0) and i < L - 1),
             ("skip", 1, lambda i: i == cfg.skip_dest_layer),
             ("dc", 2 * H, lambda i: i == L - 1))
    layout, widths = {}, [0, 0]
    for g in (0, 1):
        for kind, width, wants in kinds:
            for i in range(L):
                if gate[i] == g and wants(i):
                    if kind == "pair":
                        layout[(i, "x0")], layout[(i, "bigram")] = (g, widths[g]), (g, widths[g] + 1)
                    elif kind == "dc":
                        layout[(i, "dc_w1")], layout[(i, "dc_w2")] = (g, widths[g]), (g, widths[g] + H)
                    else:
                        layout[(i, kind)] = (g, widths[g])
                    widths[g] += width
    return layout, tuple(widths)


GATE_KIND_WIDTH = {"xsa": "H", "out": "H", "x0": 1, "bigram": 1, "skip": 1, "dc_w1": "H", "dc_w2": "H"}


def gate_cols(layout, gates, layer, kind, H):
    """Layer `layer`'s columns of one kind from the gates' outputs [(T, width0), (T, width1)]: (T, 1) or (T, H); None
    where it has none."""
    if (layer, kind) not in layout:
        return None
    g, c = layout[(layer, kind)]
    n = H if GATE_KIND_WIDTH[kind] == "H" else 1
    return gates[g][:, c: c + n]


def gate_direct(model, P, g, z, n):
    """MUDD gate g on the raw residual z (T, D): bf16(s) (W2 gelu(W1 z) + b), exact (erf) GELU, its first n outputs
    (T, n), with the model dtype's roundings of the two matmuls, the scale and the result."""
    hidden = as_model_dtype(model, F.gelu(as_model_dtype(model, z @ P["mudd_gate_w1"][g].T)))
    out = as_model_dtype(model, hidden @ P["mudd_gate_w2"][g, :n].T)
    return as_model_dtype(model, as_model_dtype(model, P["mudd_gate_scale"]) * (out + P["mudd_gate_b2"][g, :n]))


def sign_index_direct(ids, rows):
    """Sign table rows in Python integers: 0 at position 0, then (x_{t-1} XOR x_t) mod rows."""
    return [0] + [(ids[t - 1] ^ ids[t]) % rows for t in range(1, len(ids))]


def mudd_direct(model, P, block, z, n):
    """MUDD block `block` on the raw residual z (T, D): scale * (W2 gelu(W1 z) + b), exact (erf) GELU, its first n
    coefficients (T, n), with the model dtype's roundings of the two matmuls and the result."""
    hidden = as_model_dtype(model, F.gelu(as_model_dtype(model, z @ P["mudd_w1"][block].T)))
    out = as_model_dtype(model, hidden @ P["mudd_w2"][block, :n].T)
    return as_model_dtype(model, model.hp.mudd_scale * (out + P["mudd_b2"][block, :n]))


def e4m3_direct(x):
    """Nearest float8_e4m3fn values (ties to even, subnormal steps of 2^-9 below 2^-6, saturating at 448), float64."""
    def one(v):
        a = abs(v)
        step = 2.0 ** -9 if a < 2.0 ** -6 else 2.0 ** (math.floor(math.log2(a)) - 3) if a > 0 else 1.0
        return math.copysign(min(round(a / step) * step, 448.0), v)
    return torch.tensor([one(v) for v in x.flatten().tolist()], dtype=torch.float64).view(x.shape)


def mlp_direct(model, u, c_fc, c_proj):
    """relu(u @ c_fc.T)^2 @ c_proj; in training with --fp8_mlp the up projection's forward multiplies e4m3 copies:
    the weights' scaled by s = max|c_fc| / 448, the input's by 448 / max|u|, the product by s max|u| / 448."""
    if not (model.training and model.hp.fp8_mlp):
        return F.relu(u @ c_fc.T).square() @ c_proj
    s = as_model_dtype(model, c_fc.abs().max() * tk.E4M3_INV_MAX)
    w8 = e4m3_direct(as_model_dtype(model, c_fc / s))
    a = u.abs().max()
    u8 = e4m3_direct(u * (448.0 * (1 / a)))
    pre = as_model_dtype(model, (u8 @ w8.T) * (s * a * tk.E4M3_INV_MAX))
    # the FP8 down projection at a fresh state (activation scale 1) after a bootstrap refresh: weight scale
    # c = bf16(bf16(max |c_proj|) / 448), post and c_proj / c in e4m3 (saturating), the product scaled by c
    post = F.relu(pre).square()
    c = float(torch.tensor(float(torch.tensor(c_proj.abs().max().item()).bfloat16()) / 448.0).bfloat16())
    return as_model_dtype(model, (e4m3_direct(post) @ e4m3_direct(c_proj / c)) * c)


def hidden_direct(model, inputs, cu, ws_short, ws_long):
    """The forward pass in float64, layer roles read from the config; returns h = rms(final x) (T, D).
    Embedding and smear; x0 = rms, pure; the pre gate on x0; the first residual h0 = x0 plus layer 0's bigram gate
    times the signed bigram row (all D channels); per layer the gated skip (sigma(skip_lambda) times the post gate's
    skip column, per token), attention with its XSA strengths, output gates and DC weights from the gates, x0 and
    bigram injections gated per token; the post gate on the skip source's output; the last layer's VE gate, value mix
    and residual weights from MUDD block 0 on its input; then block 1's mix of h0, the cached and skip streams, the
    last layer's input and the first VE table's row into the output."""
    cfg = model.hp
    L, bs, V, D, H = cfg.num_layers, cfg.block_size, cfg.vocab_size, cfg.model_dim, cfg.num_heads
    P = {name: p.detach().double() for name, p in model.named_parameters()}
    sc = P["scalars"]
    smear_l, skip_l = sc[2 * L], sc[2 * L + 1]
    # the per-sublayer lambdas are rounded to bf16 each forward, as the record's are
    rho, pi = as_model_dtype(model, P["resid_lambdas"]), as_model_dtype(model, P["post_lambdas"])
    layout, widths = gate_layout_direct(cfg)
    ids = inputs.long()
    e = P["embed"][ids]
    T = e.shape[0]
    rows = torch.tensor(bigram_direct(inputs.tolist(), cfg.bigram_vocab_size))
    signs = model.bigram_signs.double()[torch.tensor(sign_index_direct(inputs.tolist(), cfg.bigram_sign_rows))]
    G = P["bigram_embed"][rows] * signs                                                 # (T, D)
    w_smear = P["smear_gate"][0]
    e2 = e.clone()
    for t in range(1, T):
        e2[t] = e[t] + smear_l * torch.sigmoid(e[t, :12] @ w_smear) * e[t - 1]
    x0 = f32_rms(e2)
    gates = [gate_direct(model, P, 0, x0, widths[0]), None]
    col = lambda i, kind: gate_cols(layout, gates, i, kind, H)                         # noqa: E731
    h0 = x0 + col(0, "bigram") * G
    x = h0
    ve0 = None
    saved = {}
    for i in range(L):
        last = i == L - 1
        if i == cfg.skip_dest_layer:
            x = x + torch.sigmoid(skip_l) * col(i, "skip") * saved["skip"]
        if last:
            x_in = x
            mu = mudd_direct(model, P, 0, x_in, 14)
        if cfg.attn_layout[i] != "-":
            window = (ws_long if i in cfg.long_window_layers else ws_short) * bs
            j = cfg.ve_layout[i]
            ve = P["value_embeds"][j * V + ids] if j >= 0 else None
            if j == 0:
                ve0 = ve
            u = f32_rms(saved["cached"] if i > cfg.cached_input_layer else x)
            mudd = None
            if last:   # the VE gate: mu_6 for the first half of the heads, mu_7 for the rest; the value mix
                gate = torch.stack([mu[:, 6 if h < H // 2 else 7] for h in range(H)], 1)
                mudd = (gate, mu[:, 0:1] * h0 + mu[:, 1:2] * saved["cached"] + mu[:, 2:3] * x_in)
            dc = (col(i, "dc_w1"), col(i, "dc_w2")) if (i, "dc_w1") in layout else None
            a = attention_direct(model, i, u, ve, cu, window, mudd=mudd, xsa=col(i, "xsa"), out_gate=col(i, "out"),
                                 dc=dc)
            if last:
                x = (1 + mu[:, 5:6]) * x_in + mu[:, 3:4] * h0 + mu[:, 4:5] * saved["cached"]
                x = mu[:, 8:9] * x + mu[:, 9:10] * a + mu[:, 10:11] * h0 + mu[:, 11:12] * G
            else:
                x = rho[i, 0] * x + pi[i, 0] * a + col(i, "x0") * x0 + (col(i, "bigram") * G if i > 0 else 0)
        mlp = mlp_direct(model, f32_rms(x), P["mlp"][i, 0], P["mlp"][i, 1])
        x = mu[:, 12:13] * x + mu[:, 13:14] * mlp if last else rho[i, 1] * x + pi[i, 1] * mlp
        if i == cfg.skip_source_layer:
            saved["skip"] = x
            gates[1] = gate_direct(model, P, 1, x, widths[1])
        if i == cfg.cached_input_layer:
            saved["cached"] = x
    nu = mudd_direct(model, P, 1, x, 5)
    x = x + nu[:, 0:1] * h0 + nu[:, 1:2] * saved["cached"] + nu[:, 2:3] * x_in + nu[:, 3:4] * ve0 \
        + nu[:, 4:5] * saved["skip"]
    return f32_rms(x)


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
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ---- bigram hash ---------------------------------------------------------------------------------------------------

# ids -> (bigram rows at the record's 377,280 rows, sign table rows at its 8192), worked out apart from the code in
# Python integers (the specification's table; at this modulus the t = 1 product 27191 * 377,279 wraps to a positive
# int32)
WORKED_EXAMPLES = [
    ([50256, 464, 2068, 318, 257, 1332, 13, 50256, 0, 50303],
     [377279, 86771, 28822, 34800, 135949, 256147, 75978, 202495, 6358, 245200],
     [0, 1408, 2500, 2346, 63, 1077, 1337, 1117, 1104, 1151]),
    ([0, 0, 0], [377279, 330959, 0], [0, 0, 0]),
    ([1, 2, 3], [377279, 263297, 97765], [0, 3, 1]),
    ([50256, 50256, 50256], [377279, 98067, 33688], [0, 0, 0]),
]


@pytest.mark.parametrize("inputs, rows, signs", WORKED_EXAMPLES)
def test_bigram_ids_and_sign_rows_of_worked_examples(inputs, rows, signs):
    assert tg.Hyperparameters().bigram_vocab_size == 377_280 and tg.Hyperparameters().bigram_sign_rows == 8192
    for dtype in (torch.int32, torch.int64):
        got = tg.bigram_ids(torch.tensor(inputs, dtype=dtype), 377_280)
        assert got.dtype == dtype and got.tolist() == rows
        got = tg.bigram_sign_index(torch.tensor(inputs, dtype=dtype), 8192)
        assert got.dtype == dtype and got.tolist() == signs
    # record 84's rows (754,560) of the first example: the modulus is the table's, not a constant
    assert tg.bigram_ids(torch.tensor(WORKED_EXAMPLES[0][0]), 754_560).tolist() == [
        754559, 22202, 28717, 34713, 135948, 256091, 453209, 200077, 4547, 620059]


def test_bigram_ids_check_values_and_the_position_one_quirk():
    # h(prev=464, cur=2068) = 28822; position 1 hashes with the sentinel M = table_size - 1, not x_0, as the record's
    # hash does: 86771, not 143001
    assert tg.bigram_ids(torch.tensor([7, 464, 2068]), 377_280).tolist()[2] == 28822
    b = tg.bigram_ids(torch.tensor([50256, 464]), 377_280).tolist()
    assert b[1] == 86771 and b[1] != 143001
    assert all(tg.bigram_ids(torch.tensor([x0, 464]), 377_280).tolist()[1] == 86771 for x0 in (0, 1, 50303))
    assert tg.bigram_ids(torch.tensor([5]), 377_280).tolist() == [377279]
    assert tg.bigram_ids(torch.tensor([], dtype=torch.int32), 377_280).tolist() == []
    assert tg.bigram_sign_index(torch.tensor([], dtype=torch.int32), 8192).tolist() == []
    assert tg.bigram_sign_index(torch.tensor([50303]), 8192).tolist() == [0]     # position 0: row 0 whatever the id


@pytest.mark.parametrize("table_size", [377_280, 754_560, 251_520, 97, 5 * 1024])
def test_bigram_ids_match_an_integer_transcription_on_random_tokens(table_size):
    g = torch.Generator().manual_seed(table_size)
    for T in (2, 3, 17, 300):
        ids = torch.randint(0, 50304, (T,), generator=g, dtype=torch.int32)
        ids[:2] = torch.tensor([50303, 50303])[:T]                 # the largest products, at the wrapping t = 1
        got = tg.bigram_ids(ids, table_size).tolist()
        assert got == bigram_direct(ids.tolist(), table_size)
        assert got[0] == table_size - 1 and all(0 <= b < table_size - 1 for b in got[1:])


@pytest.mark.parametrize("rows", [8192, 32, 1])
def test_sign_rows_match_an_integer_transcription_on_random_tokens(rows):
    g = torch.Generator().manual_seed(rows)
    ids = torch.randint(0, 50304, (300,), generator=g, dtype=torch.int32)
    got = tg.bigram_sign_index(ids, rows).tolist()
    assert got == sign_index_direct(ids.tolist(), rows) and all(0 <= r < rows for r in got)
    assert len(set(got)) > min(rows, 300) // 2 or rows == 1                       # spread over the table


# ---- parameters ---------------------------------------------------------------------------------------------------

def test_real_config_parameter_counts():
    """The record's parameter counts at full size on 8 GPUs (banks padded to multiples of 8): 643,751,335 in all. A
    parameter the record does not have counts on top of these."""
    model = record_model()
    counts = {k: p.numel() for k, p in dict(model.named_parameters()).items()}
    assert set(counts) == set(tg.DEFAULT_PARAM_TABLE)                 # one row per parameter
    assert sum(p.numel() for p in model.parameters()) == sum(counts.values())
    gates = dict(ve_gate_bank=360, smear_gate=12)
    lambdas = dict(scalars=24, resid_lambdas=22, post_lambdas=22)
    mudd = dict(mudd_w1=98_304, mudd_w2=1_792, mudd_b2=28)
    mudd_gates = dict(mudd_gate_w1=98_304, mudd_gate_w2=5_248, mudd_gate_b2=82, mudd_gate_scale=1)
    record = dict(qk=12_582_912, vo=14_155_776, mlp=56_623_104, lm_head=38_633_472, embed=38_633_472,
                  value_embeds=193_167_360, bigram_embed=289_751_040, **gates, **lambdas, **mudd, **mudd_gates)
    assert {k: counts.get(k) for k in record} == record
    assert sum(record.values()) == 643_751_335
    assert model.bigram_embed.shape == (377_280, 768) and model.bigram_signs.shape == (8192, 768)
    assert model.mudd_gate_w1.shape == (2, 64, 768) and model.mudd_gate_w2.shape == (2, 41, 64)
    assert model.mudd_gate_b2.shape == (2, 41) and model.mudd_gate_scale.shape == ()
    assert model.mudd_gate_scale.dtype == torch.float32
    assert "bigram_signs" in model.state_dict() and "bigram_signs" not in counts     # state, not trained
    assert model.qk.shape == (64, 256, 768) and model.vo.shape == (24, 768, 768)
    assert model.lm_head.shape == (768, 50304) and model.embed.shape == (50304, 768)
    assert {k: model.bank_matrix_shapes.get(k) for k in ("qk", "vo", "mlp")} == \
        {"qk": (256, 768), "vo": (768, 768), "mlp": (3072, 768)}
    # used (not padding), without embed and the two big tables
    used = (60 * 256 * 768 + 20 * 768 * 768 + 11 * 2 * 3072 * 768 + counts["lm_head"] + sum(gates.values())
            + sum(lambdas.values()) + sum(mudd.values()) + sum(mudd_gates.values()))
    assert used == 114_335_143


def test_real_layer_plan_is_the_records():
    """The record's 11 layers: attention kind, slots, key offset, VE table and slot, attention input per layer, XSA on
    1, 3, 4, 7 only (record 85), DC on the last, and which gate serves each layer."""
    plan = record_model().plan
    assert [p.attn for p in plan] == ["P", "N", "P", "N", "N", "P", "", "N", "N", "P", "N"]
    assert [p.attn_slot for p in plan] == [0, 1, 2, 3, 4, 5, -1, 6, 7, 8, 9]
    assert [i for i, p in enumerate(plan) if p.key_offset] == [3, 10]
    assert [p.ve_table for p in plan] == [-1, 0, 1, -1, -1, -1, -1, -1, 2, 3, 4]
    assert [p.ve_slot for p in plan] == [-1, 0, 1, -1, -1, -1, -1, -1, 2, 3, 4]
    assert [i for i, p in enumerate(plan) if p.reads_cached] == [8, 9, 10]
    assert [i for i, p in enumerate(plan) if p.skip_dest] == [6] and [p.index for p in plan if p.skip_source] == [3]
    assert [p.index for p in plan if p.cached_input] == [7]
    assert [p.index for p in plan if p.xsa] == [1, 3, 4, 7] and [p.index for p in plan if p.mudd] == [10]
    assert [p.index for p in plan if p.dc] == [10] and [p.gate for p in plan] == [0] * 4 + [1] * 7


def code_gate_layout(plan, H):
    """The code's plan as {(layer, kind): (gate, first column)}, the form of gate_layout_direct."""
    layout = {}
    for p in plan:
        for kind, col in (("xsa", p.xsa_col), ("out", p.out_gate_col), ("x0", p.inject_col),
                          ("bigram", p.inject_col + 1 if p.inject_col >= 0 else -1), ("skip", p.skip_col),
                          ("dc_w1", p.dc_col), ("dc_w2", p.dc_col + H if p.dc_col >= 0 else -1)):
            if col >= 0:
                layout[(p.index, kind)] = (p.gate, col)
    return layout


# The record's gate columns (the specification's table): (layer, kind) -> (gate, first column); 0 pre, 1 post
RECORD_GATE_COLUMNS = {
    (1, "xsa"): (0, 0), (3, "xsa"): (0, 6), (3, "out"): (0, 12),
    (0, "x0"): (0, 18), (0, "bigram"): (0, 19), (1, "x0"): (0, 20), (1, "bigram"): (0, 21),
    (2, "x0"): (0, 22), (2, "bigram"): (0, 23), (3, "x0"): (0, 24), (3, "bigram"): (0, 25),
    (4, "xsa"): (1, 0), (7, "xsa"): (1, 6), (10, "out"): (1, 12),
    (4, "x0"): (1, 18), (4, "bigram"): (1, 19), (5, "x0"): (1, 20), (5, "bigram"): (1, 21),
    (7, "x0"): (1, 22), (7, "bigram"): (1, 23), (8, "x0"): (1, 24), (8, "bigram"): (1, 25),
    (9, "x0"): (1, 26), (9, "bigram"): (1, 27), (6, "skip"): (1, 28), (10, "dc_w1"): (1, 29), (10, "dc_w2"): (1, 35),
}
# each kind's stored bias (the value at init / mudd_gate_scale) and value at init, bf16(bf16(b) bf16(0.1)), per the
# specification's table
RECORD_GATE_INIT = {"xsa": (0.0, 0.0), "out": (2.5, 0.25), "x0": (0.0, 0.0), "bigram": (0.5, 0.050048828125),
                    "skip": (5.0, 0.5), "dc_w1": (10.0, 1.0), "dc_w2": (0.0, 0.0)}


def _layout_columns(layout, widths, H):
    """Each gate's columns as a list of (layer, kind, head) (head None for one-column kinds); None where unused."""
    cols = [[None] * w for w in widths]
    for (layer, kind), (g, c) in layout.items():
        n = H if GATE_KIND_WIDTH[kind] == "H" else 1
        for j in range(n):
            assert cols[g][c + j] is None, (layer, kind, "overlaps", cols[g][c + j])
            cols[g][c + j] = (layer, kind, j if n > 1 else None)
    return cols


def test_gate_columns_at_the_record_layout_are_the_records():
    """The column layout the code derives from the record's layer plan, its widths (pre 26, post 41), and the biases
    and values at init of every column, against the specification's table."""
    model = record_model()
    H = model.hp.num_heads
    assert code_gate_layout(model.plan, H) == RECORD_GATE_COLUMNS
    assert model.gate_widths == (26, 41) == tg.mudd_gate_widths(model.plan, H)
    cols = _layout_columns(RECORD_GATE_COLUMNS, (26, 41), H)
    assert all(c is not None for gate in cols for c in gate)                 # every column has one consumer
    values = tg.mudd_gate_initial_values(model.plan, H)
    scale = torch.tensor(model.hp.mudd_gate_scale, dtype=torch.float32)
    assert scale.item() == 0.10000000149011612
    s_bf16 = scale.bfloat16()
    assert s_bf16.item() == 0.10009765625
    for g in (0, 1):
        bias = (torch.tensor(values[g]) / model.hp.mudd_gate_scale).bfloat16()
        assert bias.tolist() == [RECORD_GATE_INIT[kind][0] for _, kind, _ in cols[g]]
        at_init = (bias.float() * s_bf16.float()).bfloat16()
        assert at_init.tolist() == [RECORD_GATE_INIT[kind][1] for _, kind, _ in cols[g]]


@pytest.mark.parametrize("overrides", [
    dict(),                                                                  # the tiny preset's layout
    dict(ve_layout=(2, -1, 0, -1, -1, 1), num_value_embeds=3, cached_input_layer=1, skip_source_layer=0),
    dict(long_window_layers=(0, 2, 5), skip_source_layer=2, skip_dest_layer=3),
    dict(attn_layout="NNNN-N", long_window_layers=(), skip_source_layer=3, skip_dest_layer=4, cached_input_layer=4,
         ve_layout=(-1, 0, 1, 2, -1, 3)),
])
def test_gate_columns_follow_the_layout_rule(overrides):
    """Other layouts: the code's columns equal gate_layout_direct's, and they tile each gate without gaps."""
    cfg = tiny_cfg(**overrides)
    model = GPT(cfg, torch.device("meta"), CPU_OPS)
    want, widths = gate_layout_direct(cfg)
    assert code_gate_layout(model.plan, cfg.num_heads) == want and model.gate_widths == widths
    assert all(c is not None for gate in _layout_columns(want, widths, cfg.num_heads) for c in gate)
    if not overrides:
        assert widths == (12, 21) and tg.build_model(tg.parse_args(["--preset=tiny"]), torch.device("meta"),
                                                     "sdpa").gate_widths == (12, 21)


def _uniform_ok(x, bound):
    """max within bound (plus half a bf16 ulp), reaching near it, mean ~ 0 and std ~ bound/sqrt(3)."""
    x = x.double()
    n = x.numel()
    return (x.abs().max() <= bound * (1 + 2 ** -8) and x.abs().max() > 0.95 * bound
            and abs(x.mean()) < 4 * bound / math.sqrt(3 * n) and abs(x.std() / (bound / math.sqrt(3)) - 1) < 0.03)


def test_tiny_parameter_shapes_dtypes_and_init():
    cfg = tiny_cfg(vocab_size=1024)
    torch.manual_seed(123)
    model = GPT(cfg, torch.device("cpu"), CPU_OPS)
    D, H, L, V, hd = 64, 4, 6, 1024, 16
    P = dict(model.named_parameters())
    assert {id(p) for p in P.values()} == {id(p) for p in model.parameters()}
    assert len(P) == len(list(model.parameters()))                        # none shared
    assert set(P) == set(tg.DEFAULT_PARAM_TABLE)                          # one row per parameter
    n_ve = 4
    # the banks pad to a multiple of 8 matrices: 20 qk groups -> 24, 10 V/O -> 16, 6 MLP slices of 2 -> 8
    bf, f32 = torch.bfloat16, torch.float32
    _, widths = gate_layout_direct(cfg)
    assert widths == (12, 21)
    expect = {"qk": ((24, 2 * hd, D), bf), "vo": ((16, D, D), bf), "mlp": ((L + 2, 2, 128, D), bf),
              "lm_head": ((D, V), bf), "embed": ((V, D), bf), "value_embeds": ((4 * V, D), bf),
              "bigram_embed": ((97, D), bf), "mudd_w1": ((2, 8, D), bf),
              "mudd_w2": ((2, 14, 8), bf), "mudd_b2": ((2, 14), bf), "ve_gate_bank": ((n_ve, H, 12), bf),
              "smear_gate": ((1, 12), bf), "mudd_gate_w1": ((2, 8, D), bf), "mudd_gate_w2": ((2, 21, 8), bf),
              "mudd_gate_b2": ((2, 21), bf), "mudd_gate_scale": ((), f32),
              "resid_lambdas": ((L, 2), f32), "post_lambdas": ((L, 2), f32), "scalars": ((2 * L + 2,), f32)}
    assert set(expect) <= set(P)                                          # the record's parameters, a new one aside
    for name, (shape, dtype) in expect.items():
        assert tuple(P[name].shape) == shape and P[name].dtype == dtype, name
    b = 0.5 * math.sqrt(3) / math.sqrt(D)                          # Q, K, V, O and c_fc all U(+-b)
    assert _uniform_ok(P["qk"][:20], b) and (P["qk"][20:] == 0).all()
    assert _uniform_ok(P["vo"][:10], b) and (P["vo"][10:] == 0).all()
    assert _uniform_ok(P["vo"][1:10:2], b), "W_o is random too"
    assert _uniform_ok(P["mlp"][:, 0], b) and (P["mlp"][:, 1] == 0).all()
    for bank in ("qk", "vo", "mlp"):                               # drawn in fp32, rounded to bf16
        assert torch.equal(P[bank].float().bfloat16(), P[bank])
    ve = P["value_embeds"].double()
    assert abs(ve.std() / 0.01 - 1) < 0.03 and abs(ve.mean()) < 4 * 0.01 / math.sqrt(ve.numel())
    assert abs(P["lm_head"].float().std() / 0.005 - 1) < 0.03 and abs(P["lm_head"].float().mean()) < 2e-4
    assert torch.equal(P["embed"], P["lm_head"].T)
    for name in ("bigram_embed", "ve_gate_bank", "smear_gate", "mudd_w2", "mudd_gate_w2"):
        assert (P[name] == 0).all(), name
    # MUDD's biases (bf16) and the coefficients they give every token while W2 = 0: the last layer's static weights'
    # initial values, its VE gate at 2, and -0.5 of the cached stream after it
    b0 = [0, 0, 0, 0, 0, 0, 20, 20, 10.5, 10, 0, 0.5, 10.5, 10]
    assert P["mudd_b2"].tolist() == [b0, [0, -5] + [0] * 12]
    z = torch.randn(5, D).bfloat16()
    c = model.mudd_coefficients(0, z, tg.MUDD_LAYER_COEFFS)
    assert {k: v.unique().tolist() for k, v in c.items()} == {
        k: [v] for k, v in zip(tg.MUDD_LAYER_COEFFS, [0, 0, 0, 0, 0, 0, 2, 2, 1.046875, 1, 0, 0.050048828125,
                                                        1.046875, 1])}
    assert c["attn_resid"][0].item() == model.resid_lambdas.bfloat16()[L - 1, 0].item()
    c = model.mudd_coefficients(1, z, tg.MUDD_MIX_COEFFS)
    assert {k: v.unique().tolist() for k, v in c.items()} == {"h0": [0], "cached": [-0.5], "last_in": [0], "ve": [0],
                                                              "skip": [0]}
    assert _uniform_ok(P["mudd_w1"], D ** -0.5) and _uniform_ok(P["mudd_gate_w1"], D ** -0.5)
    assert set(model.bigram_signs.unique().tolist()) == {-1.0, 1.0} and model.bigram_signs.dtype == bf
    assert model.bigram_signs.shape == (32, D)                                  # model_dim wide (record 85)
    # the gates' biases (bf16, the stored domain: value / 0.1) and their outputs for every token while W2 = 0:
    # XSA 0, output gates 0.25, x0 0, bigram 0.05, skip 0.5, DC w1 1 and w2 0 (record 85)
    assert P["mudd_gate_scale"].item() == 0.10000000149011612
    assert P["mudd_gate_b2"].tolist() == [[0] * 4 + [2.5] * 4 + [0, 0.5] * 2 + [0] * 9,
                                          [0] * 4 + [2.5] * 4 + [0, 0.5] * 2 + [5] + [10] * 4 + [0] * 4]
    assert model.mudd_gate(0, z).unique(dim=0).tolist() == [[0] * 4 + [0.25] * 4 + [0, 0.050048828125] * 2]
    assert model.mudd_gate(1, z).unique(dim=0).tolist() == [[0] * 4 + [0.25] * 4 + [0, 0.050048828125] * 2 + [0.5]
                                                            + [1.0] * 4 + [0] * 4]
    assert (P["resid_lambdas"] == torch.tensor(math.sqrt(1.1), dtype=f32)).all()
    assert P["resid_lambdas"][0, 0].item() == pytest.approx(1.0488088, abs=1e-7)
    assert (P["post_lambdas"] == 1).all()
    s = P["scalars"].tolist()
    assert s[: 2 * L] == [0.5, 1.0] * L
    assert s[2 * L:] == [0.0, -1.5]                                               # smear, skip
    # the record's draw order from a seed: lm_head, value_embeds = bf16(0.01 n) with n drawn in bf16, qk, vo, c_fc,
    # the signs, mudd_w1's two blocks, mudd_gate_w1's two blocks
    torch.manual_seed(123)
    lm_head = torch.empty(D, V, dtype=torch.bfloat16).normal_(0.0, 0.005)
    n = torch.randn(4 * V, D, dtype=torch.bfloat16)
    qk = torch.empty(20, 2 * hd, D).uniform_(-b, b)
    vo = torch.empty(10, D, D).uniform_(-b, b)
    c_fc = torch.empty(8, 128, D).uniform_(-b, b)
    signs = torch.randn(32, D).sign()
    w1 = torch.stack([torch.empty(8, D).uniform_(-D ** -0.5, D ** -0.5) for _ in range(2)])
    gate_w1 = torch.stack([torch.empty(8, D).uniform_(-D ** -0.5, D ** -0.5) for _ in range(2)])
    assert torch.equal(model.bigram_signs, signs.bfloat16()) and torch.equal(P["mudd_w1"], w1.bfloat16())
    assert torch.equal(P["mudd_gate_w1"], gate_w1.bfloat16())
    exact = (0.01 * n.double()).bfloat16()
    assert (P["value_embeds"] != exact).float().mean() < 1e-3     # fp32 product, then bf16: rare double roundings
    assert torch.equal(P["value_embeds"], (0.01 * n.float()).bfloat16())
    assert torch.equal(P["qk"][:20], qk.bfloat16()) and torch.equal(P["vo"][:10], vo.bfloat16())
    assert torch.equal(P["mlp"][:, 0], c_fc.bfloat16()) and torch.equal(P["lm_head"], lm_head)
    # seedable from outside
    torch.manual_seed(123)
    again = GPT(cfg, torch.device("cpu"), CPU_OPS)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


def test_initial_weights_do_not_depend_on_the_bank_padding():
    """Every world size pads to bank_multiple = lcm(8, batch_slices): the drawn weights are the same."""
    torch.manual_seed(5)
    a = GPT(tiny_cfg(), torch.device("cpu"), CPU_OPS)
    torch.manual_seed(5)
    b = GPT(tiny_cfg(bank_multiple=48), torch.device("cpu"), CPU_OPS)
    assert b.qk.shape[0] == 48 and b.vo.shape[0] == 48 and a.qk.shape[0] == 24
    for name, p in a.named_parameters():
        q = getattr(b, name)
        if p.dim() == 0:
            assert torch.equal(p, q), name
            continue
        n = p.shape[0] if name not in ("qk", "vo", "mlp") else {"qk": 20, "vo": 10, "mlp": 6}[name]
        assert torch.equal(p[:n], q[:n]), name
        assert (q[n:] == 0).all() or name == "mlp", name


@pytest.mark.parametrize("slices,per,multiple,pad", [(10, 4, 8, 0), (11, 4, 8, 1), (11, 2, 8, 1), (6, 2, 8, 2),
                                                     (5, 4, 8, 1), (3, 2, 16, 5), (7, 4, 8, 1), (12, 2, 8, 0),
                                                     (60, 1, 8, 4), (20, 1, 8, 4), (60, 1, 16, 4)])
def test_bank_padding_is_the_fewest_slices_that_make_a_multiple(slices, per, multiple, pad):
    assert tg.bank_padding(slices, per, multiple) == pad
    assert (slices + pad) * per % multiple == 0
    assert all((slices + p) * per % multiple for p in range(pad))


def test_an_added_attention_layer_shards_on_eight_ranks():
    hp = tg.parse_args(["--attn_layout=PNPNNPNNNPN"])                 # 11 attention layers instead of 10
    model = tg.build_model(hp, torch.device("meta"), "sdpa")
    assert model.qk.shape[0] == 72 and model.vo.shape[0] == 24 and model.mlp.shape[0] == 12   # 66, 22 real
    for world_size in (1, 2, 4, 8):
        tg.build_optimizer(hp, model, world_size - 1, world_size)      # shards evenly: no error


def test_param_table_holds_the_records_rows():
    """The record's 19 rows in its order (the order of the gradient reductions), with their optimizer, comms, betas,
    lr_mul, wd_mul. A row the record does not have (a new idea's) may sit anywhere among them."""
    rows = [  # label, optim, comms, betas, lr_mul, wd_mul
        ("qk", "normuon", "sharded", None, 1.0, 1.0), ("vo", "normuon", "sharded", None, 1.0, 1.0),
        ("mlp", "normuon", "sharded", None, 1.0, 1.0), ("scalars", "adam", "replicated", (0.9, 0.99), 5.0, 0.0),
        ("smear_gate", "adam", "replicated", (0.9, 0.99), 0.01, 0.0),
        ("ve_gate_bank", "adam", "replicated", (0.9, 0.99), 1.0, 1.0),
        ("lm_head", "adam", "sharded", (0.5, 0.95), 1.0, 150.0),
        ("bigram_embed", "adam", "sharded", (0.75, 0.95), 75.0, 5.0),
        ("post_lambdas", "adam", "replicated", (0.9, 0.95), 1.0, 0.0),
        ("resid_lambdas", "adam", "replicated", (0.9, 0.95), 5.0, 0.0),
        ("value_embeds", "adam", "sharded", (0.75, 0.95), 75.0, 5.0),
        ("embed", "adam", "sharded", (0.5, 0.95), 1.0, 150.0),
        ("mudd_w1", "adam", "replicated", (0.9, 0.99), 0.25, 1.0),
        ("mudd_w2", "adam", "replicated", (0.9, 0.99), 0.25, 1.0),
        ("mudd_b2", "adam", "replicated", (0.9, 0.99), 0.25, 0.0),
        ("mudd_gate_w1", "adam", "replicated", (0.9, 0.99), 0.1, 1.0),
        ("mudd_gate_w2", "adam", "replicated", (0.9, 0.99), 0.1, 1.0),
        ("mudd_gate_b2", "adam", "replicated", (0.9, 0.99), 0.1, 0.0),
        ("mudd_gate_scale", "adam", "replicated", (0.9, 0.99), 0.1, 0.0)]
    table = tg.DEFAULT_PARAM_TABLE
    assert [label for label in table if label in {r[0] for r in rows}] == [r[0] for r in rows]
    for label, optim, comms, betas, lr_mul, wd_mul in rows:
        row = table[label]
        assert (row["optim"], row["comms"], row.get("betas"), row["lr_mul"], row["wd_mul"]) == \
            (optim, comms, betas, lr_mul, wd_mul), label
    assert table["mlp"]["matrix_lr_muls"] == (1.0, 2.0)
    assert all("matrix_lr_muls" not in table[k] for k in ("qk", "vo"))
    order = tg.update_order(table)
    replicated = [k for k in table if table[k]["optim"] == "adam" and table[k]["comms"] == "replicated"]
    normuon = [k for k in table if table[k]["optim"] == "normuon"]
    assert list(order[: len(replicated)]) == replicated                  # the small replicated rows first
    assert list(order[-len(normuon):]) == normuon                        # the banks' Polar Express last


def test_optimizer_sees_head_pair_groups_and_whole_vo_matrices():
    """The tiny model's banks as NorMuonAndAdam views them: qk groups (2*hd, D) with per-column second moments
    (n, 1, D), vo (D, D) with per-row ones (n, D, 1), on 1 and 8 ranks."""
    hp = tg.parse_args(["--preset=tiny"])
    model = tg.build_model(hp, torch.device("meta"), "sdpa")
    D, hd = hp.model_dim, hp.head_dim
    assert model.bank_matrix_shapes == {"qk": (2 * hd, D), "vo": (D, D), "mlp": (hp.mlp_hidden, D)}
    n_qk, n_vo = model.qk.shape[0], model.vo.shape[0]
    for world_size in (1, 8):
        opt = tg.build_optimizer(hp, model, 0, world_size)
        assert opt.buffers["qk"]["second_moment"].shape == (n_qk // world_size, 1, D)
        assert opt.buffers["qk"]["momentum"].shape == (n_qk // world_size, 2 * hd, D)
        assert opt.buffers["vo"]["second_moment"].shape == (n_vo // world_size, D, 1)
        assert opt._lr_scales["qk"] == 1.0 and opt._lr_scales["vo"] == 1.0


def test_config_validation_names_the_option():
    with pytest.raises(ValueError, match="attn_layout"):
        GPT(tiny_cfg(attn_layout="PNN-N"), torch.device("cpu"), CPU_OPS)
    # the last layer is MUDD's: normal attention, a value embedding, the cached stream before it
    for bad in (dict(attn_layout="PNN-NP"), dict(ve_layout=(-1, 0, 1, -1, 2, -1)), dict(cached_input_layer=5)):
        with pytest.raises(ValueError, match="the last layer is MUDD's"):
            GPT(tiny_cfg(**bad), torch.device("cpu"), CPU_OPS)
    with pytest.raises(ValueError, match="--mudd_gate_hidden=0 and --dc_window=5 must be at least 1"):
        GPT(tiny_cfg(mudd_gate_hidden=0), torch.device("cpu"), CPU_OPS)
    with pytest.raises(ValueError, match="--mudd_gate_hidden=8 and --dc_window=0 must be at least 1"):
        GPT(tiny_cfg(dc_window=0), torch.device("cpu"), CPU_OPS)
    for bad in (0, 24):
        with pytest.raises(ValueError, match=f"--bigram_sign_rows={bad} must be a power of two"):
            GPT(tiny_cfg(bigram_sign_rows=bad), torch.device("cpu"), CPU_OPS)
    with pytest.raises(ValueError, match="ve_layout"):
        GPT(tiny_cfg(ve_layout=(-1, 0, 1, 0, 2, 3)), torch.device("cpu"), CPU_OPS)  # VE on the attention-free layer
    with pytest.raises(ValueError, match=r"table\(s\) \[4\].*--num_value_embeds=4"):
        GPT(tiny_cfg(ve_layout=(-1, 0, 1, -1, 2, 4)), torch.device("cpu"), CPU_OPS)
    with pytest.raises(ValueError, match="num_heads"):
        GPT(tiny_cfg(num_heads=3), torch.device("cpu"), CPU_OPS)
    with pytest.raises(ValueError, match="even --num_heads"):                       # no P layer, still head pairs
        GPT(tiny_cfg(num_heads=1, head_dim=64, attn_layout="NNN-NN"), torch.device("cpu"), CPU_OPS)
    for bad in (6, -1):
        with pytest.raises(ValueError, match="cached_input_layer"):
            GPT(tiny_cfg(cached_input_layer=bad), torch.device("cpu"), CPU_OPS)
    with pytest.raises(ValueError, match="--bigram_vocab_size"):
        GPT(tiny_cfg(bigram_vocab_size=1), torch.device("cpu"), CPU_OPS)


# ---- attention paths ---------------------------------------------------------------------------------------------

def _layer_inputs(model, layer, T, seed=5):
    """A normed input, the layer's VE row (or None) and random per-token outputs of both gates, in the model's
    dtype: XSA strengths, output gates and DC weights of every size."""
    g = torch.Generator().manual_seed(seed)
    u = f32_rms(torch.randn(T, model.hp.model_dim, generator=g)).to(model.embed.dtype)
    j = model.hp.ve_layout[layer]
    ve = (0.5 * torch.randn(T, model.hp.model_dim, generator=g)).to(model.embed.dtype) if j >= 0 else None
    gates = [(0.5 + 0.6 * torch.randn(T, w, generator=g)).to(model.embed.dtype) for w in model.gate_widths]
    return u, ve, gates


def _model_attention(model, layer, u, ve, cu, window, gates):
    """model.attention with the layer's weights assembled from the banks as layer_weights reads them, its VE term
    (the gated VE, never MUDD's) and its XSA strengths, output gate and DC weights taken from `gates` by the code
    (GPT.gate_column)."""
    p = model.plan[layer]
    Wq, Wk, Wv, Wo = (w.to(model.embed.dtype) for w in layer_weights(model, layer))
    sa = model.scalars[: 2 * model.hp.num_layers].view(-1, 2)[layer]
    with torch.no_grad():
        return model.attention(p, torch.cat([Wq, Wk, Wv]), Wo, u, model.value_extra(p, u, ve, None, {}),
                               model.gate_column(gates, p, "xsa"), model.gate_column(gates, p, "out_gate"),
                               model.gate_column(gates, p, "dc"), sa, cu, 64, window)


def _direct_attention(model, layer, u, ve, cu, window, gates, **kw):
    """attention_direct with the layer's gate columns picked by gate_layout_direct."""
    layout, _ = gate_layout_direct(model.hp)
    col = lambda kind: gate_cols(layout, [g.double() for g in gates], layer, kind, model.hp.num_heads)  # noqa: E731
    dc = (col("dc_w1"), col("dc_w2")) if (layer, "dc_w1") in layout else None
    return attention_direct(model, layer, u, ve, cu, window, xsa=col("xsa"), out_gate=col("out"), dc=dc, **kw)


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
@pytest.mark.parametrize("layer, ve_layout", [(0, (2, 0, 1, -1, -1, 3)), (4, (-1, 0, 1, -1, -1, 2))])
def test_paired_attention_matches_direct(layer, ve_layout, dtype):  # with a value embedding (layer 0) and without (4)
    torch.manual_seed(0)
    model = GPT(tiny_cfg(ve_layout=ve_layout, dtype=dtype), torch.device("cpu"), CPU_OPS)
    randomize(model)
    model.attn_scale = 0.3
    T, window = 32, 12   # window in doubled positions (6 tokens)
    _, _, cu = batch(T=T, docs=(0, 13, 27))
    u, ve, gates = _layer_inputs(model, layer, T)
    got = _model_attention(model, layer, u, ve, cu, window, gates)
    want = _direct_attention(model, layer, u, ve, cu, window, gates)
    assert got.dtype == model.embed.dtype and got.shape == want.shape
    tol = 0.02 if dtype == "bfloat16" else 1e-12
    assert rel_err(got, want) < tol
    # the check is sensitive to the swapped slot-1 angle rule
    assert rel_err(got, _direct_attention(model, layer, u, ve, cu, window, gates, swap_slot=False)) > 0.05


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
# 1: long window + key offset + VE 0, XSA and an output gate; 2: VE 1, XSA; 5: long + offset + VE 3, output gate and
# DC (the last layer)
@pytest.mark.parametrize("layer", [1, 2, 5])
def test_normal_attention_matches_direct(layer, dtype):
    torch.manual_seed(0)
    model = GPT(tiny_cfg(dtype=dtype), torch.device("cpu"), CPU_OPS)
    randomize(model, seed=layer)
    model.attn_scale = 0.3
    T, window = 40, 10
    _, _, cu = batch(T=T, docs=(0, 7, 30))
    u, ve, gates = _layer_inputs(model, layer, T, seed=layer)
    got = _model_attention(model, layer, u, ve, cu, window, gates)
    want = _direct_attention(model, layer, u, ve, cu, window, gates)
    assert rel_err(got, want) < (0.02 if dtype == "bfloat16" else 1e-12)
    assert bool(DC_CALLS) == (layer == 5)
    if layer == 5:
        assert DC_CALLS[0][:2] == (model.hp.dc_window, 0.3) and torch.equal(DC_CALLS[0][2], cu)
    if dtype == "float64":
        # each of the layer's gate terms is there: without it the output is measurably another
        layout, _ = gate_layout_direct(model.hp)
        H = model.hp.num_heads
        for kind, neutral in (("xsa", 0.0), ("out", 1.0), ("dc_w2", 0.0)):
            if (layer, kind) not in layout:
                continue
            g, c = layout[(layer, kind)]
            off = [t.clone() for t in gates]
            off[g][:, c: c + H] = neutral
            assert rel_err(got, _model_attention(model, layer, u, ve, cu, window, off)) > 1e-3, kind
    if dtype == "float64" and layer in (1, 5):
        # the key offset of upstream record 61 (second and fourth quarters of the head, not its second half) is
        # measurably another function
        hd = model.hp.head_dim
        old = [d for d in range(hd) if (d // (hd // 4)) % 2 == 1]
        assert rel_err(got, _direct_attention(model, layer, u, ve, cu, window, gates, key_offset_dims=old)) > 1e-4


def test_ve_gate_input_reads_the_ve_row_on_paired_and_normal_layers():
    """The value-embedding gate reads ve's first six channels on paired (0) and normal (1) layers alike: changing them
    changes the gate (other channels of ve held). Checked through the float64 model against the transcription."""
    torch.manual_seed(0)
    model = GPT(tiny_cfg(dtype="float64", ve_layout=(3, 0, 1, -1, -1, 2)), torch.device("cpu"), CPU_OPS)
    randomize(model, seed=11)
    T, window = 24, 10
    _, _, cu = batch(T=T, docs=(0, 11))
    model.ve_gate_bank.data[:, :, 6:] *= 4                       # the ve half of the gate matters clearly
    for layer in (0, 1):
        u, ve, gates = _layer_inputs(model, layer, T, seed=3)
        ve2 = ve.clone()
        ve2[:, :6] += 1.0
        d_model = (_model_attention(model, layer, u, ve2, cu, window, gates)
                   - _model_attention(model, layer, u, ve, cu, window, gates))
        d_ref = (_direct_attention(model, layer, u, ve2, cu, window, gates)
                 - _direct_attention(model, layer, u, ve, cu, window, gates))
        assert rel_err(d_model, d_ref) < 1e-10


def test_gate_columns_reach_their_consumers_in_the_model_form():
    """GPT.gate_column: x0, bigram and skip gates as (T, 1) columns, XSA as bf16(tanh alpha) (T, H), output gates raw,
    DC's (w1, w2) with w1 normalised over the heads (fp32, eps 1e-6, rounded once) and w2 raw; None where a layer has
    none. Columns as gate_layout_direct places them."""
    model = GPT(tiny_cfg(), torch.device("cpu"), CPU_OPS)
    T, H = 7, model.hp.num_heads
    _, _, gates = _layer_inputs(model, 1, T, seed=2)
    layout, _ = gate_layout_direct(model.hp)
    for p in model.plan:
        for kind, code_kind in (("x0", "x0"), ("bigram", "bigram"), ("skip", "skip"), ("xsa", "xsa"),
                                ("out", "out_gate")):
            got, want = model.gate_column(gates, p, code_kind), gate_cols(layout, gates, p.index, kind, H)
            if want is None:
                assert got is None, (p.index, kind)
                continue
            if kind == "xsa":
                want = torch.tanh(want.float()).bfloat16()
            assert got.dtype == torch.bfloat16 and torch.equal(got, want), (p.index, kind)
        dc = model.gate_column(gates, p, "dc")
        assert (dc is None) == ((p.index, "dc_w1") not in layout)
        if dc is not None:
            raw, w2 = gate_cols(layout, gates, p.index, "dc_w1", H), gate_cols(layout, gates, p.index, "dc_w2", H)
            assert torch.equal(dc[1], w2) and dc[0].dtype == torch.bfloat16
            assert torch.equal(dc[0], dc_w1_direct(model, raw).bfloat16())


def test_gates_round_their_scale_and_their_output_once():
    """The bf16 gate: bf16 matmuls, then bf16(s) (the fp32 scale rounded as the weights are, record 85) times (out +
    b) in fp32 from the bf16 operands, rounded once to bf16. Against the float64 transcription with those rounding
    points, a few elements may differ by the fp32 accumulation order of the matmuls; rounding the bias sum to bf16
    first, or using the unrounded scale, would move a large fraction."""
    torch.manual_seed(0)
    model = GPT(tiny_cfg(), torch.device("cpu"), CPU_OPS)
    randomize(model, seed=8)
    P = {name: p.detach().double() for name, p in model.named_parameters()}
    assert model.mudd_gate_scale.bfloat16().item() != model.mudd_gate_scale.item()      # the rounding matters
    z = f32_rms(torch.randn(512, model.hp.model_dim, generator=torch.Generator().manual_seed(4))).bfloat16()
    for g, n in enumerate(model.gate_widths):
        with torch.no_grad():
            got = model.mudd_gate(g, z)
        want = gate_direct(model, P, g, z.double(), n)
        assert got.dtype == torch.bfloat16 and got.shape == (512, n)
        assert (got.double() != want).float().mean() < 0.01, g


def test_dc_weights_of_the_worked_example():
    """The specification's DC test vector, w1 at t = 0 from r1_h = 1 + 0.1 h: r1 / sqrt(mean r1^2 + 1e-6)."""
    r1 = torch.tensor([[1 + 0.1 * h for h in range(6)]], dtype=torch.float64)
    w1, w2 = tg.dc_weights(r1, 0.01 * r1)
    assert torch.allclose(w1, torch.tensor([[0.79263602, 0.87189962, 0.95116322, 1.03042682, 1.10969042,
                                              1.18895403]], dtype=torch.float64), rtol=0, atol=5e-9)
    assert torch.equal(w2, 0.01 * r1)
    # the eps inside the root: a head set of zeros stays 0, a tiny one is not blown up to rms 1
    assert torch.equal(tg.dc_weights(torch.zeros(1, 6), torch.zeros(1, 6))[0], torch.zeros(1, 6))
    tiny = tg.dc_weights(torch.full((1, 6), 1e-3, dtype=torch.float64), torch.zeros(1, 6))[0]
    assert torch.allclose(tiny, torch.full((1, 6), 1e-3 / math.sqrt(1e-6 + 1e-6), dtype=torch.float64))


def test_the_op_tables_dc_correction_is_y_exactly_while_w2_is_zero():
    """The DC correction is exactly y while w2 = 0 (its init), so at init the model is the one without it; any other
    w2 moves it."""
    g = torch.Generator().manual_seed(0)
    q, k, v, y = (torch.randn(9, 4, 16, generator=g).bfloat16() for _ in range(4))
    w1, w2 = torch.ones(9, 4).bfloat16(), torch.zeros(9, 4).bfloat16()
    cu = torch.tensor([0, 9], dtype=torch.int32)
    assert torch.equal(REAL_DC_CORRECTION(y, q, k, v, w1, w2, cu, 0.1, 5), y)
    assert not torch.equal(REAL_DC_CORRECTION(y, q, k, v, w1, w2 + 0.5, cu, 0.1, 5), y)


def test_key_offset_shifts_the_stationary_half_by_one_position():
    k = torch.randn(5, 2, 16)
    out = tk.shift_keys_by_one(k)
    assert torch.equal(out[0], k[0])
    for t in range(1, 5):
        for d in range(16):
            src = t - 1 if d >= 8 else t
            assert torch.equal(out[t, :, d], k[src, :, d])


# ---- the whole forward ---------------------------------------------------------------------------------------------

FORWARD_CFGS = {
    # the preset's layout: VE on normal (1, 2, 5) and paired (4) layers, layers 4 and 5 read rms(h3), 5 is MUDD's
    "preset": dict(),
    # VE on paired layer 0, a cached input from layer 1 read by layers 2, 4, 5 (so XSA on layer 1 only), the skip
    # and the post gate from layer 0, another bigram table
    "other": dict(ve_layout=(2, -1, 0, -1, -1, 1), num_value_embeds=3, cached_input_layer=1, skip_source_layer=0,
                  skip_dest_layer=3, bigram_vocab_size=31, bigram_sign_rows=4),
    # the FP8 up projection (a training forward)
    "fp8": dict(fp8_mlp=True),
}


@pytest.mark.parametrize("name", list(FORWARD_CFGS))
def test_float64_forward_matches_the_transcription(name):
    torch.manual_seed(0)
    model = GPT(tiny_cfg(dtype="float64", **FORWARD_CFGS[name]), torch.device("cpu"), CPU_OPS)
    randomize(model, seed=3)
    inputs, _, cu = batch(T=40, docs=(0, 17, 33))

    def final_hidden():
        """The model's h from a fresh FP8 down state (a forward advances the activation scales)."""
        if model.fp8_down is not None:
            model.fp8_down.act_scales.fill_(1.0)
        return model.final_hidden(inputs, cu, 1, 2, 64)
    with torch.no_grad():
        h = final_hidden()
        want = hidden_direct(model, inputs, cu, ws_short=1, ws_long=2)
    assert h.dtype == torch.float64
    # the FP8 down product sums in fp32
    assert rel_err(h, want) < (1e-6 if model.fp8_down is not None else 1e-10)
    assert [c[:2] for c in DC_CALLS] == [(model.hp.dc_window, model.attn_scale)]    # the model's one call
    # every parameter the forward reads matters: perturbing any one of them moves h well beyond the tolerance
    L, H = model.hp.num_layers, model.hp.num_heads
    layout, widths = gate_layout_direct(model.hp)
    unused = {("resid_lambdas", (3, 0)), ("post_lambdas", (3, 0)),
              ("scalars", (6,)), ("scalars", (7,)),                                  # layer 3 has no attention
              *((name, (L - 1, j)) for name in ("resid_lambdas", "post_lambdas") for j in (0, 1)),
              ("ve_gate_bank", (model.plan[-1].ve_slot, 0, 0)),                      # MUDD sets the last layer's
              *((name, (1, len(tg.MUDD_MIX_COEFFS), 0)[:dim]) for name, dim in (("mudd_w2", 3), ("mudd_b2", 2))),
              # the narrower gate's rows past its width
              *((name, (g, widths[g], 0)[:dim]) for g in (0, 1) if widths[g] < max(widths)
                for name, dim in (("mudd_gate_w2", 3), ("mudd_gate_b2", 2)))}
    with torch.no_grad():
        def moved_by(p, delta):
            saved = p.clone()
            p.add_(delta)
            moved = rel_err(final_hidden(), h)
            p.copy_(saved)
            return moved
        for pname in ("resid_lambdas", "post_lambdas", "bigram_embed", "value_embeds", "ve_gate_bank", "smear_gate",
                      "mudd_w1", "mudd_w2", "mudd_b2", "mudd_gate_w1", "mudd_gate_w2", "mudd_gate_b2",
                      "mudd_gate_scale", "bigram_signs"):
            p = getattr(model, pname)
            if pname == "bigram_signs":                 # the sign of every row a token pair reads flips
                rows = tg.bigram_sign_index(inputs, model.hp.bigram_sign_rows).unique()
                delta = torch.zeros_like(p)
                delta[rows] = -2 * p[rows]
                assert moved_by(p, delta) > 1e-6, pname
                continue
            idx = (1, 1) if p.dim() == 2 and pname.endswith("lambdas") else None
            delta = torch.zeros_like(p)
            if idx is None:
                delta.normal_(0, 0.1)
            else:
                delta[idx] = 0.1
            assert moved_by(p, delta) > 1e-6, pname
        # the smear and skip lambdas
        for j in (2 * L, 2 * L + 1):
            delta = torch.zeros_like(model.scalars)
            delta[j] = 0.1
            assert moved_by(model.scalars, delta) > 1e-6, j
        # every gate column, one at a time: each has a consumer that reads it
        for (layer, kind), (g, c) in layout.items():
            n = H if GATE_KIND_WIDTH[kind] == "H" else 1
            for j in range(c, c + n):
                delta = torch.zeros_like(model.mudd_gate_b2)
                delta[g, j] = 0.5
                assert moved_by(model.mudd_gate_b2, delta) > 1e-6, (layer, kind, j)
    # the parameters of the attention sublayer of the skip destination (a layer without attention) are never read
    with torch.no_grad():
        for pname, idx in unused:
            getattr(model, pname)[idx] += 0.5
        assert torch.equal(final_hidden(), h)


def test_bf16_forward_rounds_the_lambdas_and_each_update_once(monkeypatch):
    """The sublayer updates get bf16(lambda) scales and the gates' bf16 per-token columns (the skip's weight formed
    in fp32: sigma(skip_lambda) times its column); each update is one fp32 sum of bf16 operands, rounded once."""
    torch.manual_seed(0)
    model = GPT(tiny_cfg(), torch.device("cpu"), CPU_OPS)
    randomize(model, seed=4)
    seen, gates = [], {}
    real, real_gate = tg.weighted_sum, model.mudd_gate

    def spy(*terms):
        seen.append([s.detach().clone() for s, _ in terms])
        out = real(*terms)
        want = sum(s.double() * t.double() for s, t in terms)
        assert out.dtype == torch.bfloat16 and (out.double() - want).abs().max() <= 2 ** -8 * want.abs().max()
        return out

    def gate_spy(g, z):
        gates[g] = real_gate(g, z).detach()
        return gates[g]
    monkeypatch.setattr(tg, "weighted_sum", spy)
    monkeypatch.setattr(model, "mudd_gate", gate_spy)
    inputs, _, cu = batch(T=32, docs=(0, 17))
    with torch.no_grad():
        model.final_hidden(inputs, cu, 1, 2, 64)
    cfg, T = model.hp, inputs.shape[0]
    layout, _ = gate_layout_direct(cfg)
    col = lambda i, kind: gate_cols(layout, gates, i, kind, cfg.num_heads)                  # noqa: E731
    bf = lambda t: t.detach().bfloat16()                                                    # noqa: E731
    rho, pi = bf(model.resid_lambdas), bf(model.post_lambdas)
    one = torch.tensor(1.0, dtype=torch.bfloat16)
    skip_lambda = model.scalars[2 * cfg.num_layers + 1].detach()
    want = [[one, col(0, "bigram")]]
    for i, kind in enumerate(cfg.attn_layout[:-1]):
        if i == cfg.skip_dest_layer:
            want.append([one, torch.sigmoid(skip_lambda) * col(i, "skip").float()])
        if kind != "-":
            want.append([rho[i, 0], pi[i, 0], col(i, "x0")] + ([col(i, "bigram")] if i else []))
        want.append([rho[i, 1], pi[i, 1]])
    mudd = seen[len(want):]
    seen = seen[: len(want)]
    assert len(seen) == len(want)
    for got, exp in zip(seen, want):
        assert [s.dtype for s in got] == [s.dtype for s in exp] and all(torch.equal(a, b) for a, b in zip(got, exp))
        assert all(s.shape in ((), (T, 1)) for s in got)
    assert want[0][1].dtype == torch.bfloat16 and any(s.dtype == torch.float32 for w in want for s in w)
    # the last layer's three updates and the mix after it take MUDD's per-token bf16 coefficients, but the input's
    # weight 1 + mu_5 is formed in fp32 (in bf16 a small mu_5 would round away)
    assert [len(terms) for terms in mudd] == [3, 4, 2, 1 + len(tg.MUDD_MIX_COEFFS)]
    first = mudd[0][0]
    assert first.dtype == torch.float32 and first.shape == (T, 1)
    assert (first != first.bfloat16().float()).any()
    assert all(s.dtype == torch.bfloat16 and s.shape == (T, 1) for terms in mudd for s in terms[1:])
    assert all(s.dtype == torch.bfloat16 and s.shape == (T, 1) for s in mudd[1] + mudd[2])
    assert float(torch.tensor(math.sqrt(1.1))) != bf(torch.tensor(math.sqrt(1.1))).item()


def test_xsa_of_a_worked_example_rounds_once():
    """y = (1, 2, 3, 4), v = (3, 4, 0, 0), tau = bf16(tanh 0.5): y - tau <y, v> / |v|^2 v, the fp32 chain rounded once
    to bf16 (per-operation bf16 rounding would give (0.3828125, 1.1796875, 3, 4)). tau is per token and head."""
    y, v = torch.tensor([[[1.0, 2, 3, 4]]]).bfloat16(), torch.tensor([[[3.0, 4, 0, 0]]]).bfloat16()
    tau = torch.tanh(torch.tensor([[0.5]])).bfloat16()                                    # (T, H) = (1, 1)
    assert tau.item() == 0.462890625
    assert tg.remove_self_value(y, v, tau).float().flatten().tolist() == [0.388671875, 1.1875, 3, 4]
    assert [torch.tanh(torch.tensor(a)).bfloat16().item() for a in (0.1, 1.0, -0.3)] == \
        [0.099609375, 0.76171875, -0.291015625]
    # two tokens of two heads, each with its own strength: (token 0, head 1) and (token 1, head 0) untouched
    y2, v2 = y.double().expand(2, 2, 4).clone(), v.double().expand(2, 2, 4).clone()
    tau2 = torch.tensor([[1.0, 0.0], [0.0, -0.5]], dtype=torch.float64)
    out = tg.remove_self_value(y2, v2, tau2)
    along = 11 / 25 * v2[0, 0]
    for t, h in ((0, 0), (0, 1), (1, 0), (1, 1)):
        assert torch.allclose(out[t, h], y2[t, h] - tau2[t, h] * along, rtol=0, atol=1e-15), (t, h)
    # a value shorter than the floor: its squared norm is replaced by 1e-8
    tiny = torch.full((1, 1, 4), 1e-6, dtype=torch.float64)
    out = tg.remove_self_value(torch.ones(1, 1, 4, dtype=torch.float64), tiny, torch.ones(1, 1, dtype=torch.float64))
    assert torch.allclose(out, 1 - 4e-6 * 1e-6 / 1e-8 * torch.ones(4, dtype=torch.float64), rtol=0, atol=1e-15)


def test_weighted_sum_rounds_once():
    g = torch.Generator().manual_seed(0)
    x, a, b = (torch.randn(4096, generator=g).bfloat16() for _ in range(3))
    s1, s2, s3 = (torch.tensor(v).bfloat16() for v in (1.046875, 0.9, 0.050048828125))
    got = tg.weighted_sum((s1, x), (s2, a), (s3, b))
    exact = (s1.double() * x.double() + s2.double() * a.double() + s3.double() * b.double())
    assert got.dtype == torch.bfloat16
    assert (got != exact.bfloat16()).float().mean() < 1e-3                         # fp32 sum, one bf16 rounding
    eager = s1 * x + s2 * a + s3 * b                                                # rounds after every operation
    assert (eager != exact.bfloat16()).float().mean() > 0.05
    assert tg.weighted_sum((torch.tensor(2.0, dtype=torch.float64), x.double())).dtype == torch.float64


# ---- rotary / YaRN -----------------------------------------------------------------------------------------------

def test_yarn_schedule_values_and_frequencies():
    cfg = tiny_cfg(model_dim=256, num_heads=2, head_dim=128, num_layers=2, attn_layout="NN", ve_layout=(-1, 0),
                   num_value_embeds=1, long_window_layers=(1,), skip_source_layer=0, skip_dest_layer=1,
                   cached_input_layer=0, block_size=128, vocab_size=32, rotary_max_len=64)
    model = GPT(cfg, torch.device("cpu"), CPU_OPS)
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
    model = GPT(tiny_cfg(), torch.device("cpu"), CPU_OPS)
    randomize(model, seed=3)
    inputs, targets, cu = batch(T=48, docs=(0, 17, 40))
    weights = torch.tensor([1.0, 0.5, 0.25])
    with torch.no_grad():
        h_ref = hidden_direct(model, inputs, cu, ws_short=1, ws_long=2)
        h = model.final_hidden(inputs, cu, 1, 2, 64)
        # bf16 noise: at these randomised weights the bf16 model is 2-5% off the float64 model with the same values
        # (seeds 3-6), the transcription's bf16 rounding points bring it nearer
        assert rel_err(h, h_ref) < 0.04
        train_loss = model(inputs, targets, cu, 1, 2, weights, 64)
        # the loss is exactly the sum of MTP rows of the model's own logits (record 80's bf16 sigma) ...
        own = mtp_train_loss_direct(h @ model.lm_head, targets, weights)
        assert train_loss.dtype == torch.float32 and train_loss.item() == pytest.approx(own, rel=1e-5)
        # ... which is not the loss of the unrounded sigma (the rounding moves it by ~1e-4 here) ...
        assert abs(train_loss.item() - mtp_loss_direct(h @ model.lm_head, targets, weights)) > 1e-5 * own
        # ... and close to the fp32 reference of the whole model
        ref_logits = h_ref @ model.lm_head.double()
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
    model = GPT(tiny_cfg(use_fp8=use_fp8), torch.device("cpu"), CPU_OPS)
    randomize(model, seed=7)
    inputs, targets, cu = batch(T=48, docs=(0, 30))
    loss = model(inputs, targets, cu, 1, 3, torch.tensor([1.0, 0.5]), 64)
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in dict(model.named_parameters()).items():
        assert p.grad is not None and p.grad.dtype == p.dtype, name
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    # the pad slices are never read, nor the attention sublayer's lambdas of the attention-free layer 3
    assert (model.mlp.grad[model.hp.num_layers:] == 0).all()
    assert (model.qk.grad[20:] == 0).all() and (model.vo.grad[10:] == 0).all()
    assert model.resid_lambdas.grad[3, 0] == 0 and model.post_lambdas.grad[3, 0] == 0
    assert (model.scalars.grad[6:8] == 0).all()
    # nor the last layer's static weights (MUDD's replace them), nor block 1's unused rows, nor the pre gate's rows
    # past its width; every gate column in use gets a gradient
    L = model.hp.num_layers
    assert (model.resid_lambdas.grad[L - 1] == 0).all() and (model.post_lambdas.grad[L - 1] == 0).all()
    assert (model.ve_gate_bank.grad[model.plan[-1].ve_slot] == 0).all()
    n = len(tg.MUDD_MIX_COEFFS)
    assert (model.mudd_w2.grad[1, n:] == 0).all() and (model.mudd_b2.grad[1, n:] == 0).all()
    _, widths = gate_layout_direct(model.hp)
    for g in (0, 1):
        assert (model.mudd_gate_w2.grad[g, widths[g]:] == 0).all() and (model.mudd_gate_b2.grad[g, widths[g]:] == 0).all()
        assert (model.mudd_gate_b2.grad[g, : widths[g]] != 0).all(), g
    assert model.mudd_gate_scale.grad.shape == () and model.mudd_gate_scale.grad != 0
    # value-embedding rows of ids never looked up get no gradient; bigram rows likewise
    ids = batch(T=48, docs=(0, 30))[0].long()
    V = model.hp.vocab_size
    looked_up = torch.zeros(model.value_embeds.shape[0], dtype=torch.bool)
    for j in range(model.hp.num_value_embeds):
        looked_up[j * V + ids] = True
    assert (model.value_embeds.grad[~looked_up] == 0).all() and (model.value_embeds.grad[looked_up] != 0).any(-1).all()
    rows = tg.bigram_ids(batch(T=48, docs=(0, 30))[0], model.hp.bigram_vocab_size).long()
    unused = torch.ones(model.bigram_embed.shape[0], dtype=torch.bool)
    unused[rows] = False
    assert (model.bigram_embed.grad[unused] == 0).all()


def test_forward_traces_as_one_graph():
    """Dynamo (fullgraph, static shapes) must trace train and eval forward without graph breaks."""
    torch._dynamo.reset()
    model = GPT(tiny_cfg(use_fp8=True), torch.device("cpu"), CPU_OPS)
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
def test_fp8_training_head_backward_is_the_transcribed_gradient(weights, grad_scale):
    """The CPU training op (emulated head, reference loss): losses = the float64 transcription of the bf16 logits;
    dh and dW = the FP8 backward of G8 = e5m2(g) with g the transcription's fp32 gradient of grad_scale * sum(losses)
    (tail rule on the last K-1 rows), s_g = grad_scale * 0.75/448."""
    import _ce_transcription as tr
    h, w, targets = _head_case()
    mtp = torch.tensor(weights)
    s_x, s_w, s_g8 = FP8_SCALES
    losses = CPU_OPS.fp8_head_mtp_ce(h, w, targets, mtp, grad_scale, *FP8_SCALES)
    dh, dw = torch.autograd.grad(losses.sum() * grad_scale, (h, w))
    logits, x8_t, w8 = tg.fp8_head_emulated(h.detach(), w.detach(), s_x, s_w)
    want = tr.ce_train(logits, targets, weights)
    torch.testing.assert_close(losses.double(), want["losses"], rtol=1e-5, atol=1e-5)
    s_g = grad_scale * s_g8
    g32 = tr.g_fp32(want, tr.fp8_grad_factor(grad_scale, s_g))
    g8 = tr.round_e5m2(g32)
    want_dh, want_dw = tg.fp8_head_backward_emulated(g8.float().to(torch.float8_e5m2), None, x8_t, w8, s_x, s_w,
                                                     s_g)
    loose = tr.ambiguous(g32, tr.round_e5m2, 3e-5).any(1)       # rows that may legally differ by an e5m2 step
    assert loose.float().mean() < 0.2
    assert torch.equal(dh[~loose], want_dh[~loose])
    torch.testing.assert_close(dw.float(), want_dw, rtol=2e-2, atol=1e-3 * want_dw.abs().max().item())
    assert dh.dtype == dw.dtype == torch.bfloat16


def test_fp8_training_head_checks_the_incoming_gradient_on_cpu():
    """The op forms the gradient of grad_scale * sum(losses) in the forward and ignores the incoming one; on a
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
    incoming gradient per row (this path forms nothing in the forward: the incoming gradient counts)."""
    import _ce_transcription as tr
    g = torch.Generator().manual_seed(9)
    logits = (4 * torch.randn(12, 50, generator=g)).bfloat16().requires_grad_(True)
    targets = torch.randint(0, 50, (12,), generator=g)
    weights = [1.0, 0.5, 0.25]
    losses = CPU_OPS.mtp_ce_train(logits, targets, torch.tensor(weights))
    want = tr.ce_train(logits.detach(), targets, weights)
    torch.testing.assert_close(losses.double(), want["losses"], rtol=1e-5, atol=1e-5)
    grad_rows = torch.rand(12, generator=g) + 0.5
    (d,) = torch.autograd.grad(losses, logits, grad_rows)
    want_d = (grad_rows.double()[:, None] * tr.INV_C_A) * want["delta"] * want["s"] * (1 - want["s"])
    assert d.dtype == torch.bfloat16
    torch.testing.assert_close(d.double(), want_d, rtol=2 ** -7, atol=1e-6 * want_d.abs().max().item())


# ---- --kernels=torch ----------------------------------------------------------------------------------------------

def _kernels_loss(kernels: str, train: bool = True) -> tuple[tg.GPT, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(tiny_cfg(use_fp8=True), torch.device("cpu"), tg.kernel_ops(kernels, "cpu"))
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

    def relu_mlp(x, c_fc, c_proj, fp8):     # an edited activation: ReLU instead of ReLU^2
        calls.append(x.shape)
        return F.relu(x @ c_fc.mT) @ c_proj

    monkeypatch.setattr(tg.tk, "relu2_mlp_post_reference", relu_mlp)
    _, edited = _kernels_loss("torch")
    assert len(calls) == 6 and abs(edited.item() - plain.item()) > 1e-3 * abs(plain.item())
    reference_loss = tg.tk.softcapped_mtp_ce_fp8_reference

    def doubled_loss(*args):                # an edited training loss: twice the losses
        losses, g8, g8_t = reference_loss(*args)
        return 2 * losses, g8, g8_t
    monkeypatch.setattr(tg.tk, "softcapped_mtp_ce_fp8_reference", doubled_loss)
    _, doubled = _kernels_loss("torch")
    assert doubled.item() == pytest.approx(2 * edited.item(), rel=1e-6)


# ---- the prefix-token term of the training loss (record 88) --------------------------------------------------------

def prefix_table_of(V):
    """A prefix table for a small vocabulary: id t >= 8 has prefix t // 2, smaller ids none (-1)."""
    return torch.tensor([t // 2 if t >= 8 else -1 for t in range(V)], dtype=torch.int64)


@pytest.mark.parametrize("use_fp8", [False, True])
def test_prefix_weight_zero_is_the_loss_without_the_term_bit_for_bit(use_fp8):
    """w_p = 0 adds exact zeros to each row's loss and to S_w, T_c: the loss and every gradient are those of no prefix
    term, bit for bit (the prefix targets still reach the loss)."""
    torch.manual_seed(0)
    model = GPT(tiny_cfg(use_fp8=use_fp8), torch.device("cpu"), CPU_OPS)
    randomize(model, seed=3)
    tg.fill_prefix_table(model, prefix_table_of(300))
    assert torch.equal(model.prefix_table, prefix_table_of(256))
    inputs, targets, cu = batch(T=48, docs=(0, 17, 40))
    weights = torch.tensor([1.0, 0.5, 0.25])

    def loss_and_grads(*prefix):
        model.zero_grad(set_to_none=True)
        loss = model(inputs, targets, cu, 1, 2, weights, 64, 0.5, *prefix)
        (0.5 * loss).backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    plain, plain_grads = loss_and_grads()
    zero, zero_grads = loss_and_grads(torch.zeros(1))
    assert torch.equal(zero, plain) and len(zero_grads) == len(plain_grads)
    assert all(torch.equal(a, b) for a, b in zip(zero_grads, plain_grads))
    some, some_grads = loss_and_grads(torch.tensor([0.25]))
    assert some.item() != plain.item() and not all(torch.equal(a, b) for a, b in zip(some_grads, plain_grads))


def test_prefix_weight_moves_the_loss_by_w_times_the_prefix_term_of_a_float64_transcription():
    """loss(w_p) - loss(0) = w_p sum_r [tau_r >= 0] (lse_r - z[r, tau_r]), tau_r the prefix of the immediate target,
    written out per row in float64 from the model's own logits."""
    torch.manual_seed(0)
    model = GPT(tiny_cfg(dtype="float64"), torch.device("cpu"), CPU_OPS)
    randomize(model, seed=4)
    table = prefix_table_of(256)
    tg.fill_prefix_table(model, table)
    inputs, targets, cu = batch(T=48, docs=(0, 17, 40))
    weights = torch.tensor([1.0, 0.5])
    with torch.no_grad():
        logits = model.final_hidden(inputs, cu, 1, 2, 64) @ model.lm_head
        z = 23.0 * torch.sigmoid((logits.double() + 5.0) / 7.5)
        lse = torch.logsumexp(z, -1)
        term = sum((lse[r] - z[r, table[targets[r]]]).item() for r in range(48) if table[targets[r]] >= 0)
        assert sum(int(table[t]) >= 0 for t in targets) > 10      # the batch has rows with and without a prefix
        base = model(inputs, targets, cu, 1, 2, weights, 64, 1.0, torch.zeros(1)).item()
        for w in (0.25, 1.5):
            got = model(inputs, targets, cu, 1, 2, weights, 64, 1.0, torch.tensor([w])).item()
            assert got - base == pytest.approx(w * term, rel=1e-9)


def test_a_vocabulary_larger_than_the_prefix_table_is_refused_naming_the_flag():
    model = GPT(tiny_cfg(), torch.device("meta"), CPU_OPS)
    with pytest.raises(tg.harness.ConfigError, match=r"--vocab_size=256 .*data/prefix_table.py"):
        tg.fill_prefix_table(model, prefix_table_of(100))
