"""States from another recipe or shape: a state whose stored options have fields this code lacks (or lack fields it
has), or whose tensors differ from this model's, is one error line naming the difference and saying what resumes it
(exit 2), checked before anything is loaded into a model; never a traceback."""
import dataclasses

import pytest
import torch

import harness
import train_gpt as tg
from _shards import make_dataset, run_trainer

STAGE_FIELDS = [f.name for f in dataclasses.fields(tg.Stage)]


def _tiny(*args):
    return tg.resolve_dtype(tg.parse_args(["--preset=tiny", *args]), "cpu")


def _saved(hp, path="logs/r/state_step000002.pt"):
    return {"path": path, "hyperparameters": dataclasses.asdict(hp), "facts": {"processes": 2}}


def test_options_of_this_code_read_alike_give_no_difference():
    hp = _tiny()
    assert harness.option_differences(dataclasses.asdict(hp), hp) == []
    # a run-control option this code added takes its default: not a difference
    run_control = [f.name for f in dataclasses.fields(harness.RunOptions)]
    older = {k: v for k, v in dataclasses.asdict(hp).items() if k != run_control[-1]}
    assert harness.option_differences(older, hp) == []


@pytest.mark.parametrize("field", STAGE_FIELDS)
def test_stage_rows_without_a_field_this_code_has_are_named(field):
    hp = _tiny()
    saved = _saved(hp)
    for row in saved["hyperparameters"]["stages"]:
        del row[field]
    with pytest.raises(harness.ConfigError) as e:
        harness.check_state_options(saved, hp)
    assert f"--stages rows without the field {field} that this code's Stage has" in str(e.value)
    assert "with 2 process(es)" in str(e.value) and "logs/r.txt" in str(e.value)


def test_stage_rows_with_an_extra_field_an_unknown_option_and_a_missing_math_option_are_each_named():
    hp = _tiny()
    saved = _saved(hp)
    for row in saved["hyperparameters"]["stages"]:
        row["cooldown"] = 0.5
    saved["hyperparameters"]["old_knob"] = 3
    missing = harness.math_fields(hp)[0]
    del saved["hyperparameters"][missing]
    diffs = harness.option_differences(saved["hyperparameters"], hp)
    assert sorted(diffs) == sorted(["--stages rows with the field cooldown that this code's Stage lacks",
                                    "--old_knob (an option this code does not have)",
                                    f"--{missing} (an option of this code the state has no value for)"])
    # every place that reads a state's options refuses it cleanly (no TypeError from the Stage rows)
    with pytest.raises(harness.ConfigError, match="cooldown"):
        harness.check_resume(saved, hp, {"processes": 2})


def test_a_state_without_options_is_refused_as_an_older_format():
    with pytest.raises(harness.ConfigError, match="older format"):
        harness.check_state_options({"path": "x/state_step000001.pt", "facts": {}}, _tiny())


def _cpu_state(hp, step=2, world_size=1):
    model = tg.build_model(hp, torch.device("cpu"), "sdpa")
    opt = tg.build_optimizer(hp, model, world_size - 1, world_size)
    grads = {name: torch.zeros_like(p) for name, p in model.named_parameters() if "lambdas" in name}
    return {"step": step, **tg.snapshot_state(model, opt), "grads": grads, "train_time_ms": 0.0,
            "loader": dataclasses.asdict(tg.TrainPosition()), "rng": {"cpu": torch.get_rng_state()}}


def test_the_meta_built_state_has_the_layout_a_real_state_has():
    hp = _tiny()
    assert harness.layout_differences(_cpu_state(hp), tg.meta_state(hp, 0, 1)) == []


def test_a_parameter_of_another_shape_a_missing_and_an_extra_one_are_named():
    hp = _tiny()
    state = _cpu_state(hp)
    names = list(state["model"])
    shaped, gone = names[0], names[1]
    state["model"][shaped] = state["model"][shaped][:1].clone()
    del state["model"][gone]
    state["model"]["new_table"] = torch.zeros(3)
    grad = next(iter(state["grads"]))
    state["grads"][grad] = torch.zeros(7)
    diffs = harness.layout_differences(state, tg.meta_state(hp, 0, 1))
    assert any(d.startswith(f"parameter {shaped} is 1x") for d in diffs), diffs
    assert f"parameter {gone} is not in the state" in diffs
    assert "parameter new_table is in the state but not in this model" in diffs
    assert any(d.startswith(f"gradient of {grad} is 7 ") for d in diffs), diffs
    assert len(diffs) == 4


def test_optimizer_buffers_of_another_table_are_named():
    hp = _tiny()
    state = _cpu_state(hp)
    label = next(iter(state["optimizer"]["buffers"]))
    buf = next(iter(state["optimizer"]["buffers"][label]))
    state["optimizer"]["buffers"][label][buf] = state["optimizer"]["buffers"][label][buf].double()
    state["path"] = "logs/r/state_step000002.pt"
    state["hyperparameters"], state["facts"] = dataclasses.asdict(hp), {"processes": 1}
    with pytest.raises(harness.ConfigError) as e:
        harness.check_state_layout(state, tg.meta_state(hp, 0, 1), dataclasses.replace(hp, resume=state["path"]))
    assert f"optimizer buffer {label}.{buf} is" in str(e.value) and "float64 there" in str(e.value)
    assert "python3 train_gpt.py --resume=logs/r/state_step000002.pt" in str(e.value)


@pytest.mark.parametrize("dry_run", [False, True])
@pytest.mark.parametrize("change", ["stage field", "table shape"])
def test_the_trainer_refuses_a_state_of_another_recipe_with_one_line(tmp_path, change, dry_run):
    train, val = make_dataset(tmp_path / "data")
    opts = ["--preset=tiny", f"--train_files={train}", f"--val_files={val}", f"--log_dir={tmp_path / 'logs'}"]
    hp = _tiny(*opts)
    state = _cpu_state(hp)
    if change == "table shape":       # a recipe whose code sized the bigram table otherwise from the same options
        state["model"]["bigram_embed"] = state["model"]["bigram_embed"][:100].clone()
    saver = harness.Checkpointer(hp, "old", 0, 1, harness.run_facts(1, torch.device("cpu"), "sdpa",
                                                                    harness.resolve_shards(train, "train")),
                                 lambda line: None, "code")
    if change == "stage field":       # a recipe whose Stage rows had one more field
        saver.header["hyperparameters"]["stages"] = [dict(row, cooldown=0.5)
                                                     for row in saver.header["hyperparameters"]["stages"]]
    path = saver.save(state)
    r = run_trainer([*opts, f"--resume={path}", *(["--dry_run"] if dry_run else [])], cwd=tmp_path, timeout=300)
    errors = [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert len(errors) == 1 and str(path) in errors[0] and "with 1 process(es)" in errors[0], errors
    assert ("cooldown" if change == "stage field" else "parameter bigram_embed is 100x") in errors[0], errors
    assert "internal error" not in errors[0] and not (tmp_path / "logs" / "old-from2.txt").exists()
