"""A copy of the script runs itself: `cp train_gpt.py my_idea.py`, edit, run my_idea.py (directly, under torchrun, or
as TRAIN=my_idea.py ./run.sh). The copy's code is what trains, its log embeds the copy under its own name, and its
compile helpers load the copy by path under the module name the copy runs as (torch's compile caches key graphs by
the module names of the model's classes). A copy in another folder imports the siblings beside it."""
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import compile_split
from _shards import ROOT, make_dataset

HANG_GUARD_S = 600
# The edit: the LM head's initial scale, a constant that moves the very first loss.
ORIGINAL = "normal_(0.0, 0.005)"
EDITED = "normal_(0.0, 0.05)"


def _copy_tree(folder: Path, name: str, edit: tuple[str, str] | None = None) -> Path:
    """The script as `name` in `folder`, beside every sibling it imports (the top-level modules and data/) and an
    unedited train_gpt.py, as a copy made in the repository's folder has."""
    folder.mkdir(parents=True, exist_ok=True)
    for path in ROOT.glob("*.py"):
        shutil.copy2(path, folder / path.name)
    shutil.copytree(ROOT / "data", folder / "data", ignore=shutil.ignore_patterns("fineweb10B", "synthetic",
                                                                                 "__pycache__"))
    text = (ROOT / "train_gpt.py").read_text()
    if edit is not None:
        assert text.count(edit[0]) == 1, f"the edit's anchor {edit[0]!r} is not once in train_gpt.py"
        text = text.replace(*edit)
    (folder / name).write_text(text)
    return folder / name


def _final_val_loss(out: str) -> float:
    return float(re.search(r"^result: val_loss:([0-9.]+)", out, re.M).group(1))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("data"), train_tokens=60_000)


def _train(script: Path, data, log_dir: Path) -> tuple[str, str]:
    train, val = data
    args = ["--preset=tiny", f"--train_files={train}", f"--val_files={val}", "--seed=0", f"--log_dir={log_dir}",
            "--num_scheduled_iterations=3", "--num_extension_iterations=1", "--val_loss_every=0", "--run_id=copy",
            "--dtype=float32"]
    result = subprocess.run([sys.executable, str(script), *args], cwd=script.parent, capture_output=True, text=True,
                            timeout=HANG_GUARD_S)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr, (log_dir / "copy.txt").read_text()


def test_an_edited_copy_in_another_folder_trains_its_own_code_and_its_log_names_it(tmp_path, data):
    original = _copy_tree(tmp_path / "plain", "train_gpt.py")
    copy = _copy_tree(tmp_path / "ideas", "my_idea.py", (ORIGINAL, EDITED))
    out_original, _ = _train(original, data, tmp_path / "logs_plain")
    out_copy, log = _train(copy, data, tmp_path / "logs_copy")
    assert _final_val_loss(out_copy) != _final_val_loss(out_original)      # the edit is what ran
    assert f"==== my_idea.py ====\n{copy.read_text()}" in log                # the copy, verbatim, under its name
    assert "==== train_gpt.py ====" not in log
    for sibling in ("checks.py", "triton_kernels.py"):                      # the siblings beside the copy
        assert f"==== {sibling} ====\n{(copy.parent / sibling).read_text()}" in log


def test_a_copy_runs_as_a_module_named_after_it_which_its_help_names(tmp_path):
    """Run as a script (as torchrun runs it too: runpy, __main__), the copy loads itself under its stem: the name its
    compile helpers are given (module=__name__ in the helper's task)."""
    copy = _copy_tree(tmp_path, "my_idea.py")
    probe = ("import runpy, sys\n"
             f"sys.argv = [{str(copy)!r}, '--help']\n"
             "try:\n"
             f"    runpy.run_path({str(copy)!r}, run_name='__main__')\n"
             "except SystemExit as e:\n"
             "    assert e.code == 0, e.code\n"
             "m = sys.modules['my_idea']\n"
             "print('module', m.__name__, m.__file__, m.Hyperparameters.__module__)\n")
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                            timeout=HANG_GUARD_S)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"module my_idea {copy} my_idea" in result.stdout
    assert "usage: python3 my_idea.py" in result.stdout and "TRAIN=my_idea.py ./run.sh" in result.stdout


def test_a_copys_compile_helper_loads_the_copy_by_path_under_the_ranks_module_name(tmp_path, data):
    """The helper process runs the copy's code, not train_gpt.py's: here the copy's build_model says where it runs."""
    marker = "def build_model(hp: Hyperparameters, device: torch.device, attn_backend: str,\n"
    copy = _copy_tree(tmp_path, "my_idea.py")
    text = copy.read_text()
    start = text.index(marker)
    body = text.index('    """', start)
    copy.write_text(text[:body] + '    raise RuntimeError(f"the copy built as {__name__} from {__file__}")\n'
                    + text[body:])
    module = compile_split.load_script(copy)
    try:
        train, val = data
        hp = module.parse_args(["--preset=tiny", f"--train_files={train}", f"--val_files={val}"])
        task = dict(script=copy, module=module.__name__, hp=hp, device="cpu", attn_backend="sdpa", rank=0,
                    world_size=1, train_files=[train], val_files=[val])
        helper = compile_split.CompileHelper(task, [(0, "train")], tmp_path / "helper", tmp_path / "gpu.lock",
                                             compile=False)
        try:
            line = helper.wait()
        finally:
            helper.stop()
    finally:
        sys.modules.pop(module.__name__, None)
    assert module.__name__ == "my_idea"
    assert f"failed (RuntimeError: the copy built as my_idea from {copy})" in line, line
    # the task names the script in plain values: a helper reads them before it can unpickle the script's objects
    outer = pickle.loads((tmp_path / "helper.task").read_bytes())
    assert (outer["script"], outer["module"]) == (str(copy), "my_idea")
