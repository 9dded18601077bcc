"""The prefix-token term of the training loss (upstream record 88, PR #337) in the loss's plain-PyTorch reference:
a worked example in float64, and the launcher's checks of its inputs. The kernels are held to the same float64
transcription under Triton's interpreter (tests/_kernels_interp.py, the `prefix` tests)."""
import math

import pytest
import torch

import triton_kernels as tk

S = (0.5, 0.25, 0.75, 0.125)     # the row's bf16 sigma values, one per column


def logits_for(sigmas) -> torch.Tensor:
    """float64 logits whose float64 training sigma, sigmoid(l / C + B / C), is `sigmas`."""
    return torch.tensor([[tk.SOFTCAP_C * math.log(s / (1 - s)) - tk.SOFTCAP_B for s in sigmas]], dtype=torch.float64)


def delta_of(g: torch.Tensor) -> torch.Tensor:
    """delta from the reference's gradient with row factor 1: g = (delta s) (1 - s)."""
    s = torch.tensor(S, dtype=torch.float64)
    return g[0] / (s * (1 - s))


def test_a_worked_row_in_float64():
    """One row, two offsets (targets 2 then 1), prefix target 1 (also the k = 1 target) with w_p = 0.25: the loss
    has the prefix term after the offsets', T_1 holds both weights, and the deltas sum to 0."""
    logits = logits_for(S)
    w = torch.tensor([1.0, 0.5], dtype=torch.float64)
    prefix, w_p = torch.tensor([1]), torch.tensor([0.25], dtype=torch.float64)
    losses, g = tk.softcapped_mtp_ce_train_math(logits, torch.tensor([2, 1]), w, 1.0, prefix, w_p)
    z = tk.SOFTCAP_A * torch.tensor(S, dtype=torch.float64)
    lse = torch.logsumexp(z, 0).item()
    assert lse == pytest.approx(17.253188394056117, abs=1e-12)
    assert losses.item() == pytest.approx(8.630579689598205, abs=1e-12)
    assert losses.item() == pytest.approx(1.0 * (lse - z[2]) + 0.5 * (lse - z[1]) + 0.25 * (lse - z[1]), abs=1e-12)
    want = [0.005552135746154792, -0.7499823287689675, 0.7444291960801799, 9.96942635131665e-07]
    assert delta_of(g).tolist() == pytest.approx(want, abs=1e-12)
    assert delta_of(g).sum().item() == pytest.approx(0.0, abs=1e-12)


def test_the_worked_row_as_the_buffers_last_keeps_all_weights_in_s_w():
    """The same row with no row after it: only k = 0 has a target, S_w keeps all K weights and w_p (the tail rule),
    so the deltas sum to the missing offset's weight, 0.5."""
    _, g = tk.softcapped_mtp_ce_train_math(logits_for(S), torch.tensor([2]), torch.tensor([1.0, 0.5]).double(), 1.0,
                                           torch.tensor([1]), torch.tensor([0.25]).double())
    assert delta_of(g)[1].item() == pytest.approx(-0.24998232876896753, abs=1e-12)
    assert delta_of(g).sum().item() == pytest.approx(0.5, abs=1e-12)


def test_rows_without_a_prefix_target_are_the_plain_loss_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 300, generator=g) * 6).bfloat16()
    targets = torch.randint(0, 300, (6,), generator=g)
    w = torch.tensor([1.0, 0.5, 0.25])
    prefix = torch.tensor([-1, 4, -1, 17, -1, -1])
    plain = tk.softcapped_mtp_ce_train_math(logits, targets, w, 0.5)
    with_prefix = tk.softcapped_mtp_ce_train_math(logits, targets, w, 0.5, prefix, torch.tensor([0.25]))
    none = prefix < 0
    assert torch.equal(with_prefix[0][none], plain[0][none]) and torch.equal(with_prefix[1][none], plain[1][none])
    assert not torch.equal(with_prefix[0][~none], plain[0][~none])
    assert not torch.equal(with_prefix[1][~none], plain[1][~none])


@pytest.mark.parametrize("prefix, weight, message", [
    (torch.zeros(4, dtype=torch.int64), None, "together"),
    (torch.zeros(4, dtype=torch.int32), torch.zeros(1), "int64"),
    (torch.zeros(3, dtype=torch.int64), torch.zeros(1), r"shape \(4,\)"),
    (torch.zeros(4, dtype=torch.int64), torch.zeros(1, dtype=torch.float64), "fp32"),
])
def test_the_launchers_name_what_is_wrong_with_the_prefix_inputs(prefix, weight, message):
    logits, targets, w = torch.zeros(4, 64), torch.zeros(4, dtype=torch.int64), torch.ones(1)
    with pytest.raises(ValueError, match=message):
        tk.softcapped_mtp_ce_train_fwd_triton(logits, targets, w, prefix, weight)
    lse = torch.zeros(4)
    with pytest.raises(ValueError, match=message):
        tk.softcapped_mtp_ce_fp8_grad_triton(logits, targets, w, lse, 1.0, 1.0, prefix_targets=prefix,
                                             prefix_weight=weight)
