"""The layout's promises: train_gpt.py is the math and the loop (harness.py never imports it), every fused op has one
plain-PyTorch definition that a CPU runs and --kernels selects per op, an edited definition is never silently ignored,
and the split between math and run-control options is declared once."""
import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F

import harness
import checks
import train_gpt as tg
from _shards import ROOT, copy_trainer, make_dataset, run_trainer

tk = tg.tk


# ---- the layout ---------------------------------------------------------------------------------------------------

# The layout's structure (what harness.py may import, receive and name) is tested in tests/test_seams.py.


# ---- math and run control, declared once ----------------------------------------------------------------------------

def _changed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, tuple) and value and dataclasses.is_dataclass(value[0]):
        return value[:-1]
    if isinstance(value, tuple):
        return value + (value[-1],) if value else (1,)
    return {**value, "extra": {}}


def test_resume_cache_key_and_help_derive_from_one_split():
    """A field changes the compile cache's key exactly when resume refuses a change of it, exactly when it is a field
    of Hyperparameters rather than of RunOptions; --help lists it under that group."""
    hp = tg.Hyperparameters()
    saved = {"hyperparameters": dataclasses.asdict(hp), "facts": {}}
    base_key = harness.compile_cache_settings(hp, "triton")
    run_fields = {f.name for f in dataclasses.fields(harness.RunOptions)}
    help_text = harness.help_text(tg.Hyperparameters(), tg.PRESETS)
    math_help, run_help = help_text.split("==== run control")
    assert set(harness.math_fields(hp)) == {f.name for f in dataclasses.fields(hp)} - run_fields
    for f in dataclasses.fields(hp):
        other = dataclasses.replace(hp, **{f.name: _changed(getattr(hp, f.name))})
        keyed = harness.compile_cache_settings(other, "triton") != base_key
        refused = bool(harness.resume_differences(saved, other, {}))
        is_math = f.name not in run_fields
        assert keyed == refused == is_math, f.name
        assert (f"--{f.name} " in math_help) == is_math and (f"--{f.name} " in run_help) == (not is_math), f.name


# ---- one definition per op ----------------------------------------------------------------------------------------

def tiny_model(kernels: str = "fused", seed: int = 0, use_fp8: bool = False) -> tg.GPT:
    # bf16 pinned: --dtype=auto picks float32 on a CPU without bf16 instructions, which the FP8 head refuses
    hp = tg.parse_args(["--preset=tiny", "--dtype=bfloat16", f"--kernels={kernels}", f"--use_fp8={use_fp8}"])
    torch.manual_seed(seed)
    model = tg.build_model(hp, torch.device("cpu"), "sdpa")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():                   # non-zero everywhere: the zero-initialised banks would hide paths
        for name, p in model.named_parameters():   # (MUDD's biases keep the last layer's weights near 1, the
            if name not in ("scalars", "mudd_b2", "mudd_gate_b2", "mudd_gate_scale"):   # gates' theirs at init)
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return model


def loss_of(model: tg.GPT) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    T = 64
    inputs = torch.randint(0, 300, (T,), generator=g, dtype=torch.int32)
    targets = torch.randint(0, 300, (T,), generator=g, dtype=torch.int64)
    cu = torch.tensor([0, 20, 45, T, T], dtype=torch.int32)
    return model(inputs, targets, cu, 1, 3, torch.tensor([1.0, 0.5, 0.25]), 64)


def test_a_cpu_run_with_default_flags_uses_edited_activation_and_loss(monkeypatch):
    plain = loss_of(tiny_model()).item()
    reference = tk.relu2_mlp_post_reference
    monkeypatch.setattr(tk, "relu2_mlp_post_reference", lambda x, a, b, fp8: reference(x, a, b, fp8) * 2)   # an edited activation
    edited_mlp = loss_of(tiny_model()).item()
    assert abs(edited_mlp - plain) > 1e-5 * abs(plain)                       # measured 7e-4; unedited: 0
    loss_reference = tk.softcapped_mtp_ce_train_reference                                     # an edited loss
    monkeypatch.setattr(tk, "softcapped_mtp_ce_train_reference", lambda *args, **kw: 2 * loss_reference(*args, **kw))
    doubled = loss_of(tiny_model()).item()
    assert doubled == pytest.approx(2 * edited_mlp, rel=1e-6)
    qk_reference = tk.qk_norm_rotary_reference

    def sharper_queries(qkv, cos, sin, pos_mult, key_offset):  # an edited QK-norm: queries at twice the norm
        q, k, v = qk_reference(qkv, cos, sin, pos_mult, key_offset)
        return 2 * q, k, v
    monkeypatch.setattr(tk, "qk_norm_rotary_reference", sharper_queries)
    assert abs(loss_of(tiny_model()).item() - doubled) > 1e-5 * abs(doubled)   # measured 8e-5; unedited: 0


def _one_optimizer_step(kernels: str = "fused") -> dict[str, torch.Tensor]:
    model = tiny_model(kernels)
    hp = tg.parse_args(["--preset=tiny", f"--kernels={kernels}"])
    opt = tg.build_optimizer(hp, model, 0, 1)
    g = torch.Generator().manual_seed(2)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    opt.step(do_adam=True, lr_factor=1.0, momentum=0.9)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_a_cpu_run_with_default_flags_uses_edited_optimizer_steps(monkeypatch):
    plain = _one_optimizer_step()
    adam_reference = tk.adam_update_reference

    def adam_twice(param, grad, exp_avg, exp_avg_sq, **kw):      # an edited Adam step: twice the step size
        adam_reference(param, grad, exp_avg, exp_avg_sq, **{**kw, "step_size": 2 * kw["step_size"]})
    monkeypatch.setattr(tk, "adam_update_reference", adam_twice)
    adam_edited = _one_optimizer_step()
    assert not torch.equal(adam_edited["embed"], plain["embed"]) and torch.equal(adam_edited["mlp"], plain["mlp"])
    monkeypatch.undo()
    cautious = tk.cautious_step
    monkeypatch.setattr(tk, "cautious_step", lambda P, O, lr, wd: cautious(P, O, 2 * lr, wd))   # NorMuon's step
    normuon_edited = _one_optimizer_step()
    assert not torch.equal(normuon_edited["mlp"], plain["mlp"]) and torch.equal(normuon_edited["embed"],
                                                                                  plain["embed"])


def test_a_cpu_run_runs_an_edited_fp8_head_and_every_edit_whatever_kernels_asks(monkeypatch):
    """The FP8 head's reference is functions of train_gpt: an edited one changes a CPU run's loss, as an edited
    activation does, also where --kernels forces the fused kernels (off CUDA there are none)."""
    def fp8_loss(kernels: str = "fused") -> float:
        return loss_of(tiny_model(kernels, use_fp8=True)).item()
    plain = fp8_loss()
    emulated = tg.fp8_head_emulated

    def doubled_logits(h, w, s_x, s_w):      # an edited FP8 head: twice the logits
        logits, x8_t, w8 = emulated(h, w, s_x, s_w)
        return 2 * logits, x8_t, w8
    monkeypatch.setattr(tg, "fp8_head_emulated", doubled_logits)
    edited = fp8_loss()
    assert abs(edited - plain) > 1e-3 * abs(plain)
    assert fp8_loss("fp8:fused,ce:fused") == edited
    monkeypatch.undo()
    monkeypatch.setattr(tk, "relu2_mlp_post_reference", lambda x, a, b, fp8: 0 * x)    # an MLP that adds nothing
    assert fp8_loss("mlp:fused") != plain


# ---- the op table: one choice per op, made once ------------------------------------------------------------------

# Each op's fields of the table, and what they may hold as (kernel, *references); fp8's field is checked apart.
OP_FIELDS = {
    "qk": {"qk_norm_rotary": (tk.qk_norm_rotary_triton, tk.qk_norm_rotary_reference)},
    "mlp": {"relu2_mlp": (tk.relu2_mlp_post_triton, tk.relu2_mlp_post_reference),
            "relu2_mlp_fp8_down": (tk.relu2_mlp_fp8_down_triton, tk.relu2_mlp_fp8_down_reference),
            "fp8_act_scales": (tk.fp8_scales_from_partial_amax_triton, tk.fp8_scales_from_partial_amax_reference)},
    "ce": {"mtp_ce": (tk.softcapped_mtp_ce_triton, tk.softcapped_mtp_ce_reference, tk.softcapped_mtp_ce_chunked),
           "mtp_ce_train": (tk.softcapped_mtp_ce_train_triton, tk.softcapped_mtp_ce_train_reference)},
    "adam": {"adam_update": (tk.adam_update, tk.adam_update_reference)},
    "normuon": {"normuon_momentum": (tk.normuon_momentum, tk.normuon_momentum_reference),
                "cautious_update": (tk.cautious_update_with_mantissa, tk.cautious_update_with_mantissa_reference)},
    "polar": {"xxt": (tk.xxt, tk.xxt_reference), "ba_plus_cAA": (tk.ba_plus_cAA, tk.ba_plus_cAA_reference),
              "polar_split_product": (tk.polar_split_product_, tk.polar_split_product_reference)},
    "dc": {"dc_correction": (tk.dc_correction_triton, tk.dc_correction_reference)},
}


def fused_in(ops: tg.KernelOps) -> set[str]:
    """The ops whose fields in the table hold their kernels (asserting that no op is half one, half the other)."""
    fused = set()
    for op, fields in OP_FIELDS.items():
        kinds = {0 if getattr(ops, name) is kernel else 1 if any(getattr(getattr(ops, name), "func", None) is r
                                                                 or getattr(ops, name) is r for r in references)
                 else None for name, (kernel, *references) in fields.items()}
        assert kinds in ({0}, {1}), (op, kinds)
        fused |= {op} if kinds == {0} else set()
    head = ops.fp8_head_mtp_ce
    assert head.func is tg.fp8_head_mtp_ce and head.keywords["fused_ce"] == ("ce" in fused)
    return fused | ({"fp8"} if head.keywords["fused_head"] else set())


@pytest.mark.parametrize("kernels, on_cuda", [
    ("fused", set(tg.KERNEL_OPS)), ("torch", set()),
    ("mlp:torch,polar:torch,qk:torch", set(tg.KERNEL_OPS) - {"mlp", "polar", "qk"}),
    ("ce:torch,normuon:torch,mlp:fused", set(tg.KERNEL_OPS) - {"ce", "normuon"}),
    ("fp8:torch,adam:torch,adam:torch", set(tg.KERNEL_OPS) - {"fp8", "adam"})])
def test_the_op_table_holds_the_kernels_asked_for_on_cuda_and_none_elsewhere(kernels, on_cuda):
    """Choosing callables does no CUDA work, so a CPU builds a GPU run's table (no reference edited here)."""
    assert fused_in(tg.kernel_ops(kernels, "cuda", edited={})) == on_cuda
    assert fused_in(tg.kernel_ops(kernels, "cpu")) == set()
    assert tg.kernel_ops(kernels, "cpu").mtp_ce is tk.softcapped_mtp_ce_chunked   # the reference, in blocks


def test_a_bad_op_in_the_switch_names_the_ops():
    with pytest.raises(harness.ConfigError, match="--kernels=mlp:torch,attn:torch: attn:torch is not op:torch.*"
                                                  "mlp, ce, fp8, adam, normuon, polar"):
        tg.validate_hyperparameters(tg.parse_args(["--preset=tiny", "--kernels=mlp:torch,attn:torch"]), 1)


def test_an_op_asked_both_ways_is_one_error_naming_the_flag():
    with pytest.raises(harness.ConfigError) as e:
        tg.validate_hyperparameters(tg.parse_args(["--preset=tiny", "--kernels=mlp:torch,mlp:fused"]), 1)
    assert str(e.value) == ("--kernels=mlp:torch,mlp:fused asks for both mlp:torch and mlp:fused; keep one of "
                            "them") and "\n" not in str(e.value)


def test_the_recorded_reference_digests_are_those_of_the_code():
    assert checks.edited_references(tg.KERNEL_REFERENCES) == {}


def _edited_version(definition):
    """Other code under the definition's name, as an edit in the file would give."""
    def edited(*args, **kwargs):
        return definition(*args, **kwargs)
    edited.__name__ = definition.__name__
    return edited


@pytest.mark.parametrize("op", tg.KERNEL_OPS)
def test_an_edited_reference_runs_on_a_gpu_and_says_so_unless_its_kernel_is_forced(monkeypatch, op):
    definitions, digest = tg.KERNEL_REFERENCES[op]
    monkeypatch.setitem(tg.KERNEL_REFERENCES, op, ((_edited_version(definitions[0]), *definitions[1:]), digest))
    edited = checks.edited_references(tg.KERNEL_REFERENCES)
    assert list(edited) == [op] and edited[op] != digest
    names = ", ".join(d.__name__ for d in definitions)
    assert fused_in(tg.kernel_ops("fused", "cuda", edited)) == set(tg.KERNEL_OPS) - {op}
    line, = checks.kernel_switch_lines("fused", "cuda", edited, tg.KERNEL_REFERENCES)
    assert line.startswith(f"warning: {names} (op {op}) changed since its fused kernel was checked against it; "
                           "this run uses the edit")
    assert f"--kernels={op}:fused forces the kernel" in line and line.endswith(f"in KERNEL_REFERENCES to {edited[op]}")
    forced = f"{op}:fused"
    assert fused_in(tg.kernel_ops(forced, "cuda", edited)) == set(tg.KERNEL_OPS)
    line, = checks.kernel_switch_lines(forced, "cuda", edited, tg.KERNEL_REFERENCES)
    assert "uses the edit" not in line and f"uses the fused kernel (--kernels={forced}), which does NOT run the edit" in line
    assert fused_in(tg.kernel_ops(forced, "cpu", edited)) == set()
    line, = checks.kernel_switch_lines(forced, "cpu", edited, tg.KERNEL_REFERENCES)
    assert "this run uses the edit (off CUDA every op runs its reference)" in line
    assert checks.kernel_switch_lines("fused", "cuda", {}, tg.KERNEL_REFERENCES) == []


def test_the_fp8_digest_holds_only_what_the_fused_head_does_not_run():
    """fp8_quantize runs on the fused FP8 head's path too (its compiled forward quantisers), and the loss's kernels
    and references quantise the gradient themselves: it is in no digest; fp8's reference is the emulated head's
    forward and backward, which the fused head's ops never call."""
    fused_path = [tg._quantize_act, tg._quantize_weight, tg._fp8_head_forward_impl, tg._fp8_head_backward_impl]
    shared = {d for d in tg.KERNEL_REFERENCES["fp8"][0] if any(d.__name__ in
                                                            __import__("inspect").getsource(f) for f in fused_path)}
    assert tg.KERNEL_REFERENCES["fp8"][0] == (tg.fp8_head_emulated, tg.fp8_head_backward_emulated) and not shared
    assert all(tg.fp8_quantize not in refs for refs, _ in tg.KERNEL_REFERENCES.values())


def test_editing_the_one_epsilon_changes_qk_norm_and_every_rms(monkeypatch):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 32, generator=g) * 1e-3          # small rows: an eps of 1e-4 dominates their mean square
    qkv, cos, sin = torch.randn(5, 3 * 2 * 16, generator=g) * 1e-3, torch.randn(10, 8), torch.randn(10, 8)
    before = tg.rms(x), tk.qk_norm_rotary_reference(qkv, cos, sin, 1)
    monkeypatch.setattr(tk, "RMS_EPS", 1e-4)
    after = tg.rms(x), tk.qk_norm_rotary_reference(qkv, cos, sin, 1)
    assert not torch.allclose(before[0], after[0], rtol=1e-2)
    assert not torch.allclose(before[1][0], after[1][0], rtol=1e-2)
    assert not torch.allclose(before[1][1], after[1][1], rtol=1e-2)
    _, launch = tk._qk_rotary_launch(qkv, 2, 16, 2, None)          # the kernel's eps, read at each launch
    assert launch["EPS"] == 1e-4
    assert loss_of(tiny_model()).item() != pytest.approx(_unedited_tiny_loss(), rel=1e-6)


def _unedited_tiny_loss() -> float:
    with pytest.MonkeyPatch.context() as m:
        m.setattr(tk, "RMS_EPS", 2.0 ** -23)
        return loss_of(tiny_model()).item()


def test_comments_layout_and_docstrings_are_not_edits(tmp_path):
    import importlib.util
    import inspect
    versions = {
        "same": 'def f(x):\n    """Doc."""\n    return x * 2\n',
        "commented": ('def f(x):\n    """Another docstring."""\n    # a comment\n'
                      '    return (x *\n            2)  # why\n'),
        "edited": 'def f(x):\n    """Doc."""\n    return x * 3\n'}
    digests = {}
    for name, code in versions.items():
        (tmp_path / f"{name}.py").write_text(code)
        spec = importlib.util.spec_from_file_location(f"probe_{name}", tmp_path / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        digests[name] = harness.reference_digest([inspect.getsource(module.f)])
    assert digests["same"] == digests["commented"] != digests["edited"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_edited_loss_changes_a_default_cpu_run_and_is_named_at_start(tmp_path):
    """The README's path for a new loss: edit softcapped_mtp_ce_reference. A copy of the project with the loss doubled
    starts with a warning naming the op and its flag, and its first validation loss is twice the unedited run's."""
    train, val = make_dataset(tmp_path / "d", train_tokens=120_000, val_tokens=20_000)
    edited = tmp_path / "edited"
    edited.mkdir()
    copy_trainer(edited)
    kernels = (edited / "triton_kernels.py").read_text()
    body = kernels[kernels.index("def softcapped_mtp_ce_reference("):]
    body = body[:body.index("\n    return losses\n")]
    kernels = kernels.replace(body + "\n    return losses\n", body + "\n    return 2 * losses\n")
    (edited / "triton_kernels.py").write_text(kernels)
    args = ["--preset=tiny", "--num_scheduled_iterations=3", "--num_extension_iterations=1", "--val_loss_every=2",
            "--seed=0", f"--train_files={train}", f"--val_files={val}"]
    logs = {}
    for label, root in (("plain", ROOT), ("edited", edited)):
        p = run_trainer([*args, f"--log_dir={tmp_path}/{label}", f"--run_id={label}"], tmp_path, timeout=600,
                        script=root / "train_gpt.py")
        assert p.returncode == 0, p.stderr[-2000:]
        logs[label] = (tmp_path / label / f"{label}.txt").read_text()
    first_val = {label: float(re.search(r"^step:0/\d+ val_loss:([0-9.]+)", log, re.M)[1])
                 for label, log in logs.items()}
    assert first_val["edited"] == pytest.approx(2 * first_val["plain"], abs=2e-4)
    # the log holds the code too, so a line of the run is one that starts with the text
    assert re.search(r"^warning: softcap, softcapped_mtp_ce_reference, softcapped_mtp_ce_train_math, "
                     r"_SoftcappedMTPCETrainReference, softcapped_mtp_ce_fp8_reference \(op ce\) changed .* this run "
                     r"uses the edit \(off CUDA every op runs its reference\)", logs["edited"], re.M)
    assert not re.search(r"^warning: ", logs["plain"], re.M)


def test_the_chunked_loss_is_the_reference_in_blocks():
    """Past a memory bound a CPU runs the loss's reference a block of rows at a time (each block sees the targets of
    the rows after it); in float64 that is the reference's numbers, losses and gradients."""
    g = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(50, 300, generator=g, dtype=torch.float64)).requires_grad_()
    targets = torch.randint(0, 300, (50,), generator=g)
    weights = torch.tensor([1.0, 0.5, 0.25], dtype=torch.float64)
    ref = tk.softcapped_mtp_ce_reference(logits, targets, weights)
    ref_grad, = torch.autograd.grad(ref.sum(), logits)
    for rows in (7, 16, 50):
        got = tk.softcapped_mtp_ce_chunked(logits, targets, weights, rows=rows)
        grad, = torch.autograd.grad(got.sum(), logits)
        torch.testing.assert_close(got, ref, rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-14)
    assert tk.softcapped_mtp_ce_chunked(logits, targets, weights).shape == (50,)
