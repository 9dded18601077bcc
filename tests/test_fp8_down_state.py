"""The FP8 down projection's delayed-scaling state (record 89) in the model and the loop: a tiny CPU run with
--fp8_mlp=true trains; the state (activation scales per batch slice and layer, weight scales and the scales set
aside per bank slot) is part of the model's state, so a resumed state refreshes the FP8 weights bit for bit as the
straight run does, also past the bootstrap steps; each slice owns its activation scales, so they do not depend on the
world size. The whole-run resume with --fp8_mlp=true is tests/test_resume.py's."""
import pytest
import torch

import train_gpt as tg
import triton_kernels as tk
from _shards import make_dataset, run_gloo, run_trainer
from test_model import CPU_OPS, GPT, batch, masked_sdpa, randomize, tiny_cfg
from test_train_e2e import load_ckpt, val_losses


def fp8_model(seed=0):
    torch.manual_seed(seed)
    model = GPT(tiny_cfg(fp8_mlp=True, batch_slices=2), torch.device("cpu"), CPU_OPS)
    randomize(model, seed=seed)
    return model


def fp8_state(model):
    down = model.fp8_down
    return [t.clone() for t in (down.act_scales, down.weight_scales, down.next_weight_scales,
                                down.weights8.view(torch.uint8))]


def test_the_state_is_in_the_models_state_dict_and_only_with_fp8_mlp():
    names = {"fp8_down.act_scales", "fp8_down.weight_scales", "fp8_down.next_weight_scales"}
    model = GPT(tiny_cfg(fp8_mlp=True, batch_slices=2), torch.device("cpu"), CPU_OPS)
    assert names <= set(model.state_dict()) and "fp8_down.weights8" not in model.state_dict()
    L, slots = model.hp.num_layers, model.mlp.shape[0]
    assert model.fp8_down.act_scales.shape == (2, L) and model.fp8_down.weight_scales.shape == (slots,)
    assert not names & set(GPT(tiny_cfg(fp8_mlp=False), torch.device("cpu"), CPU_OPS).state_dict())
    # the record's layout, and the compatibility check sees it: a state without it is another recipe's
    record = tg.build_model(tg.Hyperparameters(), torch.device("meta"), "sdpa")
    assert record.fp8_down.act_scales.shape == (8, 11) and record.fp8_down.weight_scales.shape == (12,)
    assert names <= set(tg.meta_state(tg.parse_args(["--preset=tiny", "--fp8_mlp=true"]), 0, 1)["model"])


def test_a_training_forward_advances_its_slices_scales_and_eval_none(monkeypatch):
    """The forward of slice b uses row b and leaves in it 1.80 max(post) / 448 per layer; the other row, and every
    row in eval, stays."""
    monkeypatch.setattr(tg, "varlen_attention", masked_sdpa)
    model = fp8_model()
    inputs, targets, cu = batch(T=32, docs=(0, 9))
    down = model.fp8_down
    model(inputs, targets, cu, 1, 3, torch.tensor([1.0, 0.5]), 64, 1.0, None, down.act_scales[1])
    assert torch.equal(down.act_scales[0], torch.ones(model.hp.num_layers))
    row = down.act_scales[1].clone()
    assert (row != 1.0).all() and (row > 0).all()
    model.eval()
    with torch.no_grad():
        model(inputs, targets, cu, 1, 3, torch.tensor([1.0]), 64)
    assert torch.equal(down.act_scales[1], row) and torch.equal(down.act_scales[0], torch.ones_like(row))


@pytest.mark.parametrize("steps", [(3, 4), (20, 21)])
def test_a_loaded_state_refreshes_the_fp8_weights_bit_for_bit(steps):
    """Save after the refresh of one optimizer step, load into a fresh model (rebuild_fp8_down), refresh both after
    the next step: the same scales and FP8 weights, bootstrapping (3, 4) or from the scales set aside (20, 21)."""
    model = fp8_model()
    first, second = steps
    assert tk.fp8_down_bootstraps(first) == (first < tk.FP8_DOWN_BOOTSTRAP_STEPS)
    model.refresh_fp8_down(first)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    other = fp8_model(seed=1)
    other.load_state_dict(saved)
    other.rebuild_fp8_down()
    assert all(torch.equal(a, b) for a, b in zip(fp8_state(other), fp8_state(model)))
    with torch.no_grad():
        for m in (model, other):
            m.mlp.mul_(1.07)            # an optimizer step's change of the banks
            m.refresh_fp8_down(second)
    assert all(torch.equal(a, b) for a, b in zip(fp8_state(other), fp8_state(model)))
    # past the bootstrap the scale used is the one set aside before the change: without restoring it, another
    fresh = fp8_model(seed=1)
    with torch.no_grad():
        fresh.mlp.copy_(model.mlp)
    fresh.refresh_fp8_down(second)
    same = torch.equal(fresh.fp8_down.weight_scales, model.fp8_down.weight_scales)
    assert same == tk.fp8_down_bootstraps(second)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_tiny_cpu_run_with_the_fp8_mlp_trains(tmp_path):
    train, val = make_dataset(tmp_path / "d", train_tokens=400_000, val_tokens=20_000)
    p = run_trainer(["--preset=tiny", "--fp8_mlp=true", "--num_scheduled_iterations=12",
                     "--num_extension_iterations=2", "--val_loss_every=7", "--seed=0", "--warmup=false",
                     f"--train_files={train}", f"--val_files={val}", f"--log_dir={tmp_path}/logs",
                     "--run_id=fp8", "--save_checkpoint=true"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    losses = val_losses(p.stdout)
    assert losses[14] < losses[0] - 0.5, losses
    state = load_ckpt(tmp_path / "logs", "fp8", 14)["model"]
    assert (state["fp8_down.act_scales"] != 1.0).all()          # both slices' chains advanced
    assert (state["fp8_down.weight_scales"] != 1.0).all()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_activation_scales_do_not_depend_on_the_world_size(tmp_path):
    """Two slices: one process runs both through their own chains, two processes one each; slice b's row is the same
    (to the float32 rounding of the weights it sees: the reductions add in another order), and a rank leaves the rows
    it does not own at 1. In float64, so that the weights agree to 1e-13 whatever the thread count; the scales are
    fp32 (the recipe's), so they agree to their last bit."""
    train, val = make_dataset(tmp_path / "d", train_tokens=400_000, val_tokens=20_000)
    common = ["--preset=tiny", "--dtype=float64", "--fp8_mlp=true", "--num_scheduled_iterations=3",
              "--num_extension_iterations=1", "--val_loss_every=0", "--seed=0", "--warmup=false",
              "--save_checkpoint=true", "--batch_slices=2", f"--train_files={train}", f"--val_files={val}",
              f"--log_dir={tmp_path}/logs"]
    steps = tg.parse_args(common).num_iterations
    one = run_trainer([*common, "--run_id=one"], tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    for p in run_gloo([*common, "--run_id=two"], 2, tmp_path):
        assert p.returncode == 0, p.stderr[-3000:]
    a1 = load_ckpt(tmp_path / "logs", "one", steps)["model"]["fp8_down.act_scales"]
    assert a1.shape == (2, tg.parse_args(common).num_layers) and (a1 != 1.0).all() and not torch.equal(a1[0], a1[1])
    for rank in range(2):
        a2 = load_ckpt(tmp_path / "logs", "two", steps, rank=rank)["model"]["fp8_down.act_scales"]
        # the slices' own rows differ by 5-15 %
        assert ((a2[rank] - a1[rank]).abs() <= 1e-6 * a1[rank]).all(), (rank, a1, a2)
        assert torch.equal(a2[1 - rank], torch.ones_like(a2[1 - rank]))
