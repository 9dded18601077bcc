"""The data scripts stand alone: each file in data/ imports with numpy and the standard library only (no torch, no
triton, none of the trainer's files; huggingface_hub and tiktoken only inside the functions that download or
tokenize), imported as the scripts see each other and run as `python data/NAME.py --help`. And the shard format has
one definition, in data/shards.py, which the trainer's reader imports. (That the trainer reads what data/shards.py
writes is tests/test_data_scripts.py::test_shard_format_agrees_with_the_trainer.)"""
import ast
import json
import os
import subprocess
import sys

import pytest

from _data_helpers import DATA_DIR, ROOT

# what a data script must not load: the trainer's files and its heavy dependencies
TRAINER_MODULES = {"torch", "triton", "harness", "train_gpt", "triton_kernels", "compile_split"}
# loaded only by the function that downloads (huggingface_hub) or tokenizes (tiktoken), never by an import or --help
LAZY_MODULES = {"huggingface_hub", "tiktoken"}
SCRIPTS = sorted(os.path.splitext(name)[0] for name in os.listdir(DATA_DIR)
                 if name.endswith(".py") and name != "__init__.py")
CLI_SCRIPTS = [name for name in SCRIPTS
               if 'if __name__ == "__main__":' in open(os.path.join(DATA_DIR, f"{name}.py")).read()]
FORMAT = {"SHARD_MAGIC": 20240520, "SHARD_VERSION": 1, "SHARD_HEADER_BYTES": 1024}

PRINT_MODULES = "import json, sys; print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"


def _env():
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _top_level_modules(code, cwd):
    """The top-level names in sys.modules of a fresh `python -c` after `code`."""
    p = subprocess.run([sys.executable, "-c", f"{code}\n{PRINT_MODULES}"], cwd=cwd, capture_output=True, text=True,
                       timeout=120, env=_env())
    assert p.returncode == 0, p.stderr[-3000:]
    return set(json.loads(p.stdout.splitlines()[-1]))


def test_the_scripts_are_found():
    assert {"shards", "cached_fineweb10B", "synthetic", "tokenize_docs"} <= set(SCRIPTS)
    assert {"cached_fineweb10B", "synthetic", "tokenize_docs"} <= set(CLI_SCRIPTS)


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_data_script_imports_without_the_trainer(name, tmp_path):
    """Imported as a sibling, with data/ first on sys.path as when a script runs (from a folder that holds nothing)."""
    loaded = _top_level_modules(f"import sys; sys.path.insert(0, {DATA_DIR!r}); import {name}", tmp_path)
    assert name in loaded and "numpy" in loaded
    assert not loaded & TRAINER_MODULES, sorted(loaded & TRAINER_MODULES)
    assert not loaded & LAZY_MODULES, sorted(loaded & LAZY_MODULES)


@pytest.mark.parametrize("name", CLI_SCRIPTS)
def test_a_data_scripts_help_loads_no_trainer(name, tmp_path):
    """`python data/NAME.py --help`, the real command line; -X importtime lists every module the run imported."""
    p = subprocess.run([sys.executable, "-X", "importtime", os.path.join(DATA_DIR, f"{name}.py"), "--help"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120, env=_env())
    assert p.returncode == 0 and "usage:" in p.stdout, p.stderr[-3000:]
    loaded = {line.split("|")[-1].strip().split(".")[0] for line in p.stderr.splitlines()
              if line.startswith("import time:") and "|" in line}
    assert {"numpy", "shards"} <= loaded, sorted(loaded)
    assert not loaded & TRAINER_MODULES, sorted(loaded & TRAINER_MODULES)
    assert not loaded & LAZY_MODULES, sorted(loaded & LAZY_MODULES)


def test_the_shard_module_imports_without_the_trainer_as_data_shards(tmp_path):
    """As the trainer imports it, from the repository root."""
    loaded = _top_level_modules(f"import sys; sys.path.insert(0, {str(ROOT)!r}); import data.shards", tmp_path)
    assert "data" in loaded and not loaded & TRAINER_MODULES, sorted(loaded & TRAINER_MODULES)


def _module_assignments(path):
    """{name: value node or None} of the module-level assignments in the file at `path` (`a, b = 1, 2` included)."""
    out = {}
    for node in ast.parse(open(path).read()).body:
        pairs = []
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Tuple):
                    values = node.value.elts if isinstance(node.value, ast.Tuple) else [None] * len(target.elts)
                    pairs += zip(target.elts, values)
                else:
                    pairs.append((target, node.value))
        elif isinstance(node, ast.AnnAssign):
            pairs.append((node.target, node.value))
        out.update((t.id, v) for t, v in pairs if isinstance(t, ast.Name))
    return out


def test_the_shard_format_is_defined_once_in_data_shards():
    """data/shards.py assigns the three constants, as literals; no other file of the project or of data/ does, and
    the shard reader (checks.py) imports them from data.shards."""
    defined = _module_assignments(os.path.join(DATA_DIR, "shards.py"))
    assert {name: ast.literal_eval(defined[name]) for name in FORMAT if name in defined} == FORMAT
    others = [os.path.join(ROOT, n) for n in sorted(os.listdir(ROOT)) if n.endswith(".py")]
    others += [os.path.join(DATA_DIR, n) for n in sorted(os.listdir(DATA_DIR))
               if n.endswith(".py") and n != "shards.py"]
    redefined = {os.path.relpath(p, ROOT): sorted(set(_module_assignments(p)) & set(FORMAT)) for p in others}
    assert not {p: names for p, names in redefined.items() if names}, redefined
    imports = [node for node in ast.parse(open(os.path.join(ROOT, "checks.py")).read()).body
               if isinstance(node, ast.ImportFrom) and node.module == "data.shards"]
    assert imports and set(FORMAT) <= {a.name for node in imports for a in node.names}


def test_the_trainer_reads_with_the_constants_of_data_shards():
    """The trainer's shard reader (checks.py) uses data/shards.py's very objects, from data/, a regular package (so
    no other `data` on sys.path can stand in for it)."""
    import checks as tg
    import data
    import data.shards
    assert data.__file__ == os.path.join(DATA_DIR, "__init__.py")
    assert data.shards.__file__ == os.path.join(DATA_DIR, "shards.py")
    for name, value in FORMAT.items():
        assert getattr(tg, name) is getattr(data.shards, name) and getattr(tg, name) == value, name
