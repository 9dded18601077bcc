"""The layout's promises: train_gpt.py is the math and the loop (harness.py never imports it), every fused op has one
plain-PyTorch definition that a CPU runs and --kernels selects per op, an edited definition is never silently ignored,
and the split between math and run-control options is declared once."""
import dataclasses
import re
import shutil

import pytest
import torch
import torch.nn.functional as F

import harness
import train_gpt as tg
from _shards import ROOT, make_dataset, run_trainer

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

def tiny_model(kernels: str = "fused", seed: int = 0) -> tg.GPT:
    hp = tg.parse_args(["--preset=tiny", f"--kernels={kernels}"])
    torch.manual_seed(seed)
    model = tg.build_model(hp, torch.device("cpu"), "sdpa")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():                   # non-zero everywhere: the zero-initialised banks would hide paths
        for name, p in model.named_parameters():
            if name not in ("scalars", "x0_lambdas"):
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
    reference = tk.relu2_mlp_reference
    monkeypatch.setattr(tk, "relu2_mlp_reference", lambda x, a, b: reference(x, a, b) * 2)   # an edited activation
    edited_mlp = loss_of(tiny_model()).item()
    assert abs(edited_mlp - plain) > 1e-3 * abs(plain)
    loss_reference = tk.softcapped_mtp_ce_reference
    monkeypatch.setattr(tk, "softcapped_mtp_ce_reference", lambda *args: 2 * loss_reference(*args))  # an edited loss
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


def test_the_per_op_switch_runs_exactly_the_ops_asked_for(monkeypatch):
    """Each op has a dispatcher (the kernel on CUDA, the reference elsewhere) and a reference; --kernels=op:torch
    calls the reference directly. Recording both shows which one the model and the optimizer chose."""
    pairs = {"qk": ("qk_norm_rotary", "qk_norm_rotary_reference"), "mlp": ("relu2_mlp", "relu2_mlp_reference"),
             "ce": ("softcapped_mtp_ce", "softcapped_mtp_ce_reference"),
             "normuon": ("normuon_momentum", "normuon_momentum_reference"), "polar": ("xxt", "xxt_reference")}
    calls = []

    def recorder(name, fn):
        def wrapped(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return wrapped
    for dispatcher, reference in pairs.values():
        dispatch_fn, reference_fn = getattr(tk, dispatcher), getattr(tk, reference)
        monkeypatch.setattr(tk, dispatcher, recorder(dispatcher, dispatch_fn))
        monkeypatch.setattr(tk, reference, recorder(reference, reference_fn))
    for kernels, as_reference in [("fused", set()), ("mlp:torch,polar:torch,qk:torch", {"mlp", "polar", "qk"}),
                                  ("ce:torch,normuon:torch,mlp:fused", {"ce", "normuon"}),
                                  ("torch", set(pairs))]:
        calls.clear()
        loss_of(tiny_model(kernels)).backward()
        _one_optimizer_step(kernels)
        for op, (dispatcher, reference) in pairs.items():
            # a dispatcher off CUDA calls the reference itself, so the reference is seen either way
            assert (dispatcher in calls) == (op not in as_reference), (kernels, op)
            assert reference in calls, (kernels, op)


def test_a_bad_op_in_the_switch_names_the_ops():
    with pytest.raises(harness.ConfigError, match="--kernels=mlp:torch,attn:torch: attn:torch is not op:torch.*"
                                                  "mlp, ce, fp8, adam, normuon, polar"):
        tg.validate_hyperparameters(tg.parse_args(["--preset=tiny", "--kernels=mlp:torch,attn:torch"]), 1)


def test_the_recorded_reference_digests_are_those_of_the_code():
    assert harness.edited_references(tg.KERNEL_REFERENCES, frozenset(), on_cuda=True) == []


def test_an_edited_reference_gets_a_warning_naming_its_op_and_flag():
    def relu2_mlp_reference(x, c_fc, c_proj):      # the same name, other code
        return F.relu(x @ c_fc.mT) @ c_proj
    table = {**tg.KERNEL_REFERENCES, "mlp": ((relu2_mlp_reference,), tg.KERNEL_REFERENCES["mlp"][1])}
    fused, = harness.edited_references(table, frozenset(), on_cuda=True)
    assert re.search(r"^warning: relu2_mlp_reference \(op mlp\) changed .* NOT the edit: --kernels=mlp:torch", fused)
    on_cpu, = harness.edited_references(table, frozenset(), on_cuda=False)
    asked, = harness.edited_references(table, frozenset({"mlp"}), on_cuda=True)
    assert "this run uses the edit" in on_cpu and "this run uses the edit" in asked


def test_comments_layout_and_docstrings_are_not_edits(tmp_path):
    import importlib.util
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
        digests[name] = harness.reference_digest((module.f,))
    assert digests["same"] == digests["commented"] != digests["edited"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_edited_loss_changes_a_default_cpu_run_and_is_named_at_start(tmp_path):
    """The README's path for a new loss: edit softcapped_mtp_ce_reference. A copy of the project with the loss doubled
    starts with a warning naming the op and its flag, and its first validation loss is twice the unedited run's."""
    train, val = make_dataset(tmp_path / "d", train_tokens=120_000, val_tokens=20_000)
    edited = tmp_path / "edited"
    edited.mkdir()
    for name in ("train_gpt.py", "harness.py", "triton_kernels.py", "compile_split.py"):
        shutil.copy(ROOT / name, edited / name)
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
    assert "warning: softcap, softcapped_mtp_ce_reference (op ce) changed" in logs["edited"]
    assert "--kernels=ce:torch" in logs["edited"] and "warning: " not in logs["plain"]


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
    assert tk.softcapped_mtp_ce(logits, targets, weights).shape == (50,)
