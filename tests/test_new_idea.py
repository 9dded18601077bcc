"""A new idea breaks no test about something else: the README's edit "a new parameter" (create it in GPT.__init__, use
it in the forward pass, give it a row in DEFAULT_PARAM_TABLE), made here to a copy of the trainer, passes the model and
optimizer tests.

The copy is every top-level .py file of the repository plus data/, in a temporary folder; the edit adds a learned
scalar, `new_idea_scale`, that multiplies the final hidden state (1 at the start, so the model starts as the record's),
with an Adam row copied from the `scalars` row. The tests of tests/test_model.py and tests/test_optimizer.py that read
the model or the optimizer table then run in a subprocess with TRAIN_GPT_FILE naming the copy (tests/conftest.py
imports it as `train_gpt`, its folder first on sys.path), and must all pass: a test that hard-codes the parameter
list, the table or a count fails there.
"""
import ast
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "new_idea_scale"
TEST_FILES = ("tests/test_model.py", "tests/test_optimizer.py")
# Left out: the tests of functions that read neither the model nor the optimizer table (Polar Express, the Adam and
# NorMuon updates, the bigram hash, the FP8 casts and head, weighted_sum, bank_padding, the key offset, the momentum's
# lerp weights). The edit cannot change them, and they are about a third of the two files' time. A test renamed out of
# this list runs anyway.
NOT_ABOUT_PARAMETERS = ("polar_express", "adam_update", "normuon_update", "cautious_update", "variance_normalize",
                        "mantissa_master", "bigram_ids", "fp8_", "weighted_sum", "bank_padding_is", "key_offset_shifts",
                        "momentum_lerp")


class AnchorMissing(AssertionError):
    pass


def _find(nodes, kind, name, where):
    for node in nodes:
        if isinstance(node, kind) and node.name == name:
            return node
    raise AnchorMissing(f"the edit's anchor is gone: no {kind.__name__} {name} in {where}; update "
                        "tests/test_new_idea.py to where the README now says a new parameter goes")


def _table_node(tree):
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (node.targets[0] if isinstance(node, ast.Assign)
                                                                      and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id == "DEFAULT_PARAM_TABLE" and isinstance(node.value, ast.Dict):
            return node.value
    raise AnchorMissing("the edit's anchor is gone: no module-level `DEFAULT_PARAM_TABLE = {...}` dict in "
                        "train_gpt.py; update tests/test_new_idea.py to where the optimizer table now lives")


def _is_self_scalars(node):
    if not isinstance(node, (ast.Assign, ast.AnnAssign)):
        return False
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return any(isinstance(t, ast.Attribute) and t.attr == "scalars" and isinstance(t.value, ast.Name)
               and t.value.id == "self" for t in targets)


def add_a_learned_scalar(source: str) -> str:
    """The README's three steps for a new parameter, on the text of train_gpt.py:
    - GPT.__init__: after the statement `self.scalars = ...`, `self.new_idea_scale = nn.Parameter(...)`, a 0-d tensor
      of ones of the scalars' dtype and device;
    - GPT.final_hidden: every `return h` becomes `return (h) * self.new_idea_scale`;
    - DEFAULT_PARAM_TABLE: a row "new_idea_scale" before the first, its value the text of the "scalars" row.
    Each anchor that is missing fails naming it."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    gpt = _find(tree.body, ast.ClassDef, "GPT", "train_gpt.py")
    init = _find(gpt.body, ast.FunctionDef, "__init__", "class GPT")
    hidden = _find(gpt.body, ast.FunctionDef, "final_hidden", "class GPT")
    edits = []          # (line index, column, end line index, end column, new text), applied from the last

    anchor = next((node for node in ast.walk(init) if _is_self_scalars(node)), None)
    if anchor is None:
        raise AnchorMissing("the edit's anchor is gone: no `self.scalars = ...` in GPT.__init__; update "
                            "tests/test_new_idea.py to where the model's parameters are now created")
    indent = " " * anchor.col_offset
    line = f"{indent}self.{NAME} = nn.Parameter(torch.ones_like(self.scalars[0]))  # the new idea: a learned scalar\n"
    after = anchor.end_lineno                   # past the comment lines that continue the statement's comment
    while after < len(lines) and lines[after].strip().startswith("#") and \
            len(lines[after]) - len(lines[after].lstrip()) > anchor.col_offset:
        after += 1
    edits.append((after, 0, after, 0, line))

    returns = [node for node in ast.walk(hidden) if isinstance(node, ast.Return) and node.value is not None]
    if not returns:
        raise AnchorMissing("the edit's anchor is gone: GPT.final_hidden returns nothing; update "
                            "tests/test_new_idea.py to where the forward pass now ends")
    for node in returns:
        v = node.value
        text = ast.get_source_segment(source, v)
        edits.append((v.lineno - 1, v.col_offset, v.end_lineno - 1, v.end_col_offset, f"({text}) * self.{NAME}"))

    table = _table_node(tree)
    keys = [k.value for k in table.keys if isinstance(k, ast.Constant)]
    if "scalars" not in keys or NAME in keys:
        raise AnchorMissing(f"DEFAULT_PARAM_TABLE has no 'scalars' row to copy (rows: {keys}), or already a "
                            f"{NAME!r} row")
    row = ast.get_source_segment(source, table.values[keys.index("scalars")])
    first = table.keys[0]
    edits.append((first.lineno - 1, first.col_offset, first.lineno - 1, first.col_offset,
                  f'"{NAME}": {row},  # the new idea\n' + " " * first.col_offset))

    for l0, c0, l1, c1, text in sorted(edits, reverse=True):
        if l0 == len(lines):
            lines.append("")
        head, tail = lines[l0][:c0], lines[l1][c1:]
        lines[l0:l1 + 1] = [head + text + tail]
    edited = "".join(lines)
    ast.parse(edited)
    return edited


def make_copy(folder) -> str:
    """Every top-level .py file of the repository and data/ (its scripts, not downloaded data) in folder; the path of
    the copy of train_gpt.py."""
    for name in sorted(os.listdir(ROOT)):
        if name.endswith(".py") and os.path.isfile(os.path.join(ROOT, name)):
            shutil.copy2(os.path.join(ROOT, name), folder)

    def downloads(path, names):
        return [n for n in names if os.path.isdir(os.path.join(path, n))]
    if os.path.isdir(os.path.join(ROOT, "data")):
        shutil.copytree(os.path.join(ROOT, "data"), os.path.join(folder, "data"), ignore=downloads)
    return os.path.join(folder, "train_gpt.py")


# After the tests, in the same process: the parameters of the model those tests saw (the module conftest.py
# imported), its table, and the files of the modules imported from the repository's root or the copy's folder.
RUNNER = textwrap.dedent("""
    import json, os, sys
    import pytest
    rc = pytest.main(sys.argv[1:])
    import torch
    import train_gpt as tg
    model = tg.build_model(tg.parse_args(["--preset=tiny"]), torch.device("meta"), "sdpa")
    folders = {os.environ["NEW_IDEA_REPO"], os.path.dirname(os.environ["TRAIN_GPT_FILE"])}
    modules = {name: m.__file__ for name, m in list(sys.modules.items())
               if os.path.isabs(getattr(m, "__file__", None) or "") and os.path.dirname(m.__file__) in folders}
    print("NEW_IDEA " + json.dumps(dict(trainer=tg.__file__, parameters=sorted(dict(model.named_parameters())),
                                        table=list(tg.DEFAULT_PARAM_TABLE), modules=modules)))
    sys.exit(rc)
""")


def run_tests_against(trainer: str, *pytest_args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """The model and optimizer tests of this repository run against `trainer` (TRAIN_GPT_FILE); what the runner
    reports about the module they imported."""
    env = dict(os.environ, TRAIN_GPT_FILE=trainer, NEW_IDEA_REPO=ROOT)
    tests = [os.path.join(ROOT, f) for f in TEST_FILES]
    cmd = [sys.executable, "-c", RUNNER, "-q", "-p", "no:cacheprovider", *pytest_args, *tests]
    proc = subprocess.run(cmd, cwd=os.path.dirname(trainer), env=env, capture_output=True, text=True, timeout=900)
    report = next((json.loads(line[len("NEW_IDEA "):]) for line in proc.stdout.splitlines()
                   if line.startswith("NEW_IDEA ")), None)
    return proc, report


def test_the_edit_changes_what_the_readme_names():
    """The edit itself, read back: one parameter created after self.scalars, the forward's end scaled by it, one row."""
    with open(os.path.join(ROOT, "train_gpt.py")) as f:
        source = f.read()
    edited = add_a_learned_scalar(source)
    added = [line.strip() for line in edited.splitlines() if NAME in line]
    assert len(added) >= 3, added
    assert added[0].startswith(f'"{NAME}": dict(') and added[1].startswith(f"self.{NAME} = nn.Parameter(")
    assert all(line.startswith("return (") and line.endswith(f") * self.{NAME}") for line in added[2:])
    assert len(edited.splitlines()) == len(source.splitlines()) + 2
    with pytest.raises(AnchorMissing, match="self.scalars"):
        add_a_learned_scalar(source.replace("self.scalars = ", "self.lambdas = "))
    with pytest.raises(AnchorMissing, match="DEFAULT_PARAM_TABLE"):
        add_a_learned_scalar(source.replace("DEFAULT_PARAM_TABLE:", "PARAM_TABLE:"))
    with pytest.raises(AnchorMissing, match="final_hidden"):
        add_a_learned_scalar(source.replace("def final_hidden(", "def hidden("))


@pytest.mark.slow
def test_model_and_optimizer_tests_pass_with_a_new_learned_scalar(tmp_path):
    trainer = make_copy(tmp_path)
    with open(trainer) as f:
        source = f.read()
    with open(trainer, "w") as f:
        f.write(add_a_learned_scalar(source))
    proc, report = run_tests_against(trainer, "-k", "not (" + " or ".join(NOT_ABOUT_PARAMETERS) + ")")
    out = proc.stdout[-8000:] + proc.stderr[-3000:]
    assert report is not None, f"the runner reported nothing:\n{out}"
    # the tests ran against the edited copy, beside the copy's own siblings, and the new parameter was live there
    assert report["trainer"] == trainer, report
    assert all(os.path.dirname(path) != ROOT for path in report["modules"].values()), report["modules"]
    assert NAME in report["parameters"] and report["table"][0] == NAME, report
    assert proc.returncode == 0, f"tests failed against the trainer with a new parameter:\n{out}"
    assert " passed" in proc.stdout, out
