"""The seam between the script and its run machinery: train_gpt.py is the math and the timed loop and calls harness.py
with plain values; harness.py never imports the script, never receives a callable, the trainer, the model or the
optimizer, and knows none of the model's or optimizer's vocabulary. Everything that runs inside a training step is in a
file the log embeds verbatim."""
import ast
import sys

import pytest
import torch

import harness
import train_gpt as tg
from _shards import ROOT, make_dataset

SCRIPT_OBJECTS = {"trainer", "model", "opt", "optimizer", "compiled", "self"}   # what the machinery must not hold
VOCABULARY = ("NorMuon", "normuon", "param_table", "attn_layout", "ve_layout", "lm_head", "Trainer", "GPT",
              "bank", "yarn", "rotary", "polar", "train_step")


def _tree(name):
    return ast.parse((ROOT / name).read_text())


def test_harness_imports_no_project_file():
    imported = {a.name.split(".")[0] for n in ast.walk(_tree("harness.py")) if isinstance(n, ast.Import)
                for a in n.names}
    imported |= {(n.module or "").split(".")[0] for n in ast.walk(_tree("harness.py"))
                 if isinstance(n, ast.ImportFrom)}
    assert not imported & {"train_gpt", "triton_kernels", "compile_split"}, imported
    assert "import_module" not in (ROOT / "harness.py").read_text()


def test_harness_names_none_of_the_models_or_optimizers_vocabulary():
    text = (ROOT / "harness.py").read_text()
    found = [w for w in VOCABULARY if w in text]
    assert not found, f"harness.py names {found}: that code belongs beside the model or the optimizer"


def test_no_harness_function_takes_a_callable_or_a_script_object():
    bad = []
    for node in ast.walk(_tree("harness.py")):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            for a in args:
                annotation = ast.unparse(a.annotation) if a.annotation is not None else ""
                if "Callable" in annotation or a.arg in SCRIPT_OBJECTS - {"self"}:
                    bad.append(f"{node.name}({a.arg}: {annotation})")
    assert not bad, bad


def _script_definitions():
    tree = _tree("train_gpt.py")
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def _harness_calls():
    """Every call in train_gpt.py into harness: harness.f(...), or a method of a value harness made (run, the
    checkpointer, the compile log, the profiler, the NaN watch, the command line's outcome)."""
    made = {"run", "checkpointer", "compile_log", "profiler", "finite", "outcome"}
    for node in ast.walk(_tree("train_gpt.py")):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Name) and owner.id in {"harness", *made}:
                yield node


def _values_walk(node):
    """The nodes of an argument, leaving out the inside of calls: a call's result is a value."""
    yield node
    if not isinstance(node, ast.Call):
        for child in ast.iter_child_nodes(node):
            yield from _values_walk(child)


def test_the_script_passes_harness_only_values():
    """No lambda, no function or class of the script, no trainer / model / optimizer crosses the seam; so the
    machinery cannot call back up, and a walk from prepare_training never climbs back into the script."""
    script_defs, bad = _script_definitions(), []
    calls = list(_harness_calls())
    for call in calls:
        for arg in [*call.args, *(k.value for k in call.keywords)]:
            for node in _values_walk(arg):
                if isinstance(node, ast.Lambda) or (isinstance(node, ast.Name) and (
                        node.id in script_defs or node.id in SCRIPT_OBJECTS)) or (
                        isinstance(node, ast.Attribute) and node.attr in SCRIPT_OBJECTS):
                    bad.append(f"line {call.lineno}: {ast.unparse(call)}")
    assert len(calls) > 20 and not bad, bad


def test_the_timed_loop_and_its_clock_are_in_the_script():
    """What decides train_time (the clock, where it starts and pauses, the syncs) is in train_gpt.py, which the log
    embeds verbatim; harness.py has no clock of its own."""
    script = _tree("train_gpt.py")
    names = {n.name for n in script.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert {"TrainClock", "timed_loop"} <= names
    loop = next(n for n in script.body if isinstance(n, ast.FunctionDef) and n.name == "timed_loop")
    calls = {ast.unparse(n.func) for n in ast.walk(loop) if isinstance(n, ast.Call)}
    assert {"clock.start", "clock.paused"} <= calls
    assert not any("Clock" in n.name for n in ast.walk(_tree("harness.py")) if isinstance(n, ast.ClassDef))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_file_a_training_step_runs_is_embedded_in_the_log(tmp_path):
    """A traced training step and validation (tiny model, CPU) run code of the files the script names as its code
    only (train_gpt.py, checks.py, triton_kernels.py), among the project's files; a run's log holds each in full."""
    train, val = make_dataset(tmp_path / "data", train_tokens=60_000)
    args = ["--preset=tiny", f"--train_files={train}", f"--val_files={val}", "--seed=0", f"--log_dir={tmp_path}",
            "--num_scheduled_iterations=3", "--num_extension_iterations=1", "--val_loss_every=0", "--run_id=seam"]
    hp = tg.parse_args(args)
    model = tg.build_model(hp, torch.device("cpu"), "sdpa")
    opt = tg.build_optimizer(hp, model, 0, 1)
    trainer = tg.Trainer(hp, model, model, opt, torch.device("cpu"), 0, 1, harness.resolve_shards(train, "train"),
                         harness.resolve_shards(val, "val"))
    sched = tg.schedule_at(0, hp)
    trainer.train_step(sched, trainer.advance_schedule(sched))      # the loader's first batches, outside the trace
    files = set()

    def trace(frame, event, arg):
        path = frame.f_code.co_filename
        if path.startswith(str(ROOT)) and path != __file__:         # this test's own frame returns too
            files.add(path[len(str(ROOT)) + 1:])
    sys.setprofile(trace)
    try:
        sched = tg.schedule_at(1, hp)
        trainer.train_step(sched, trainer.advance_schedule(sched))
        trainer.validate(sched.ws_short, sched.ws_long, max_batches=1)
    finally:
        sys.setprofile(None)
    embedded = {path.name for path in tg.code_files()}
    assert {"train_gpt.py", "triton_kernels.py"} <= files <= embedded, files
    assert tg.main(args) == 0
    log = (tmp_path / "seam.txt").read_text()
    for name in sorted(embedded):
        assert f"==== {name} ====\n{(ROOT / name).read_text()}" in log
