"""Scripts in notes/ are records of what they measured, and the shipped code moves on under them. A script that imports
shipped code (train_gpt.py, harness.py, triton_kernels.py, compile_split.py, or a module of bench/, tools/ or data/)
imports it from a checkout of the commit it was run at, named by a module-level PINNED_COMMIT, through
pinned_checkout(): `--repo=PATH` names the checkout, and without it the script stops with one error line that says
which commit to check out, before it imports anything heavy. Its folder's README names that commit and the command.
Every .py under notes/ is checked, parsed, never imported."""
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "notes").rglob("*.py"))
FOLDERS = ("bench", "tools", "data")   # imported as packages, or their files put on sys.path by folder
SHIPPED = ({p.stem for p in ROOT.glob("*.py")} | set(FOLDERS)
           | {p.stem for folder in FOLDERS for p in (ROOT / folder).glob("*.py")}) - set(sys.stdlib_module_names)
LOADERS = ("spec_from_file_location", "SourceFileLoader", "run_path")   # files loaded by path
SHA = re.compile(r"[0-9a-f]{40}")


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _call_name(node: ast.Call) -> str:
    return node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")


def imported_names(tree: ast.Module) -> set[str]:
    """The top-level name of every module the file imports anywhere in it (inside functions too): import
    statements, importlib.import_module / __import__ of a literal name, and .py files loaded by path."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and _call_name(node) in ("import_module", "__import__"):
            names |= {arg.value.split(".")[0] for arg in node.args[:1]
                      if isinstance(arg, ast.Constant) and isinstance(arg.value, str)}
        elif isinstance(node, ast.Call) and _call_name(node) in LOADERS:
            names |= {Path(c.value).stem for c in ast.walk(node)
                      if isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value.endswith(".py")}
    return names


def shipped_imports(path: Path) -> set[str]:
    """The shipped modules a notes script imports; its own folder's modules (the snapshot copies) are its own."""
    local = {p.stem for p in path.parent.glob("*.py")}
    return imported_names(ast.parse(path.read_text(encoding="utf-8"))) & (SHIPPED - local)


def pinned_commit(tree: ast.Module) -> str | None:
    """The string that a module-level `PINNED_COMMIT = "..."` gives, else None."""
    for node in tree.body:
        if (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["PINNED_COMMIT"]
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            return node.value.value
    return None


def _parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


IMPORTING = [p for p in SCRIPTS if shipped_imports(p)]
PINNED = [p for p in SCRIPTS if pinned_commit(_parsed(p)) is not None]


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


def _full_history() -> bool:
    """A git checkout with its whole history (a fresh clone), not an export without .git or a shallow clone."""
    if not (ROOT / ".git").exists():
        return False
    shallow = _git("rev-parse", "--is-shallow-repository")
    return shallow.returncode == 0 and shallow.stdout.strip() == "false"


def test_the_scripts_are_found():
    assert SCRIPTS and PINNED, "no .py under notes/, or none pinned: the glob or the convention's marker moved"


@pytest.mark.parametrize("script", SCRIPTS, ids=_rel)
def test_a_notes_script_imports_shipped_code_only_from_a_pinned_checkout(script):
    shipped = shipped_imports(script)
    assert not shipped or pinned_commit(_parsed(script)) is not None, (
        f"{_rel(script)} imports {sorted(shipped)} from the tree it lies in, and breaks silently when a name moves. "
        "Either copy what it measured into its README and drop the import, or name the commit it ran at in a "
        "module-level PINNED_COMMIT and import from that checkout through pinned_checkout() (as the other pinned "
        "scripts do)")


@pytest.mark.parametrize("script", PINNED, ids=_rel)
def test_a_pinned_commit_is_a_full_commit_of_this_history(script):
    sha = pinned_commit(_parsed(script))
    assert SHA.fullmatch(sha), f"{_rel(script)}: PINNED_COMMIT {sha!r} is not a 40-digit lower-case hex commit"
    if not _full_history():
        pytest.skip("no .git with its whole history (an export or a shallow clone): the commit cannot be looked up")
    assert _git("cat-file", "-e", f"{sha}^{{commit}}").returncode == 0, (
        f"{_rel(script)}: PINNED_COMMIT {sha} is not a commit of this repository")


@pytest.mark.parametrize("script", PINNED, ids=_rel)
def test_a_pinned_script_finds_its_checkout_before_any_other_import(script):
    """Module level, before pinned_checkout() is called, only the standard library is imported, so that the check is
    quick and no shipped module can come from this tree; the call is at module level, where the imports are."""
    tree = _parsed(script)
    for node in tree.body:
        if any(isinstance(n, ast.Call) and _call_name(n) == "pinned_checkout" for n in ast.walk(node)):
            break
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = ({a.name.split(".")[0] for a in node.names} if isinstance(node, ast.Import)
                     else {(node.module or "").split(".")[0]})
            outside = names - set(sys.stdlib_module_names) - {"__future__"}
            assert not outside, f"{_rel(script)}: imports {sorted(outside)} before pinned_checkout()"
    else:
        pytest.fail(f"{_rel(script)}: has PINNED_COMMIT but never calls pinned_checkout() at module level")


@pytest.mark.parametrize("script", PINNED, ids=_rel)
def test_a_pinned_scripts_readme_names_its_commit_and_command(script):
    sha = pinned_commit(_parsed(script))
    readme = (script.parent / "README.md").read_text(encoding="utf-8")
    assert sha[:7] in readme, f"{_rel(script.parent)}/README.md does not name {_rel(script)}'s commit {sha[:7]}"
    command = re.search(rf"{re.escape(script.name)} --repo=\S*{sha[:7]}", readme.replace("\n", " "))
    assert command, f"{_rel(script.parent)}/README.md shows no `{script.name} --repo=...{sha[:7]}` command"


def _run(script: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, str(script), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("script", PINNED, ids=_rel)
def test_a_pinned_script_without_its_checkout_says_which_commit_in_one_error_line(script, tmp_path):
    sha = pinned_commit(_parsed(script))
    for args in ((), ("--repo=" + str(tmp_path),)):   # no --repo; a folder that is no checkout
        proc = _run(script, *args, cwd=tmp_path)
        lines = proc.stderr.splitlines()
        assert proc.returncode != 0 and proc.stdout == "", (args, proc.returncode, proc.stdout, proc.stderr[-2000:])
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, proc.stderr[-2000:])
        assert sha in lines[0] and f"git worktree add /tmp/at-{sha[:7]} {sha[:7]}" in lines[0], lines[0]


STUB = "import sys\nprint('stub ' + __name__ + ' from ' + __file__)\nsys.exit(97)\n"


@pytest.mark.slow
@pytest.mark.parametrize("script", PINNED, ids=_rel)
def test_a_pinned_script_imports_the_shipped_code_from_its_checkout(script, tmp_path):
    """With --repo naming a checkout whose every shipped module is a stub that exits 97 on import, the script's first
    shipped import is the stub's: nothing comes from the tree around it (run with a working directory elsewhere)."""
    checkout = tmp_path / "checkout"
    for module in sorted(SHIPPED):
        folder = next((f for f in FOLDERS if (ROOT / f / f"{module}.py").exists()), "")
        target = checkout / folder / f"{module}.py"
        if module not in FOLDERS:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(STUB)
    proc = _run(script, f"--repo={checkout}", cwd=tmp_path)
    assert proc.returncode == 97 and f"from {checkout}{os.sep}" in proc.stdout, (
        proc.returncode, proc.stdout[-1000:], proc.stderr[-3000:])
