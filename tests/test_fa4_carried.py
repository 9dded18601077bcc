"""bench/fa4_carried.sh on a CPU: two fake wheels packed into the two halves, the halves added one call at a time, and
the unpacked packages importable with the PYTHONPATH it prints (the dsl_packages folder included, as
nvidia-cutlass-dsl's .pth file would add it)."""
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from _shards import ROOT

pytestmark = pytest.mark.skipif(not (shutil.which("unzip") and shutil.which("xz")),
                                reason="bench/fa4_carried.sh needs unzip and xz")


def fake_wheel(path, files):
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, text in files.items():
            z.writestr(name, text)


def test_pack_add_env_round_trip(tmp_path):
    tree = tmp_path / "tree"
    (tree / "bench").mkdir(parents=True)
    shutil.copy2(ROOT / "bench" / "fa4_carried.sh", tree / "bench" / "fa4_carried.sh")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    fake_wheel(wheels / "a-1-py3-none-any.whl", {"fa_fake/__init__.py": "VALUE = 41\n",
                                                 # incompressible bytes, so that each half holds part of them
                                                 "fa_fake/blob.bin": os.urandom(200_000).hex()})
    fake_wheel(wheels / "b-1-py3-none-any.whl",
               {"nvidia_cutlass_dsl/dsl_packages/dsl_fake/__init__.py": "VALUE = 1\n"})
    env = dict(os.environ, FA4_SITE=str(tmp_path / "site"), FA4_PARTS=str(tmp_path / "parts"))
    script = ["bash", str(tree / "bench" / "fa4_carried.sh")]

    def run(*args):
        r = subprocess.run([*script, *args], cwd=tree, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stdout

    run("pack", str(wheels))
    halves = [(tree / d / "part").stat().st_size for d in (".fa4a", ".fa4b")]
    assert min(halves) > 0 and abs(halves[0] - halves[1]) <= 1
    assert "the other half comes with the next call" in run("add", ".fa4a")
    assert not (tmp_path / "site").exists()
    assert "unpacked into" in run("add", ".fa4b")
    line = run("env").strip()
    assert line.startswith("export PYTHONPATH=")
    probe = subprocess.run(["bash", "-c", f'{line}; "{sys.executable}" -c '
                            '"import fa_fake, dsl_fake; print(fa_fake.VALUE + dsl_fake.VALUE)"'],
                           env=env, capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "42", probe.stderr


def test_unknown_command_is_a_usage_line():
    r = subprocess.run(["bash", str(ROOT / "bench" / "fa4_carried.sh"), "unpack"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("usage: bench/fa4_carried.sh")


def test_a_missing_folder_is_one_error_line(tmp_path):
    env = dict(os.environ, FA4_SITE=str(tmp_path / "site"), FA4_PARTS=str(tmp_path / "parts"))
    for args, fix in ((["pack", str(tmp_path / "nope")], "folder of wheels"),
                      (["add", str(tmp_path)], ".fa4a or .fa4b")):
        r = subprocess.run(["bash", str(ROOT / "bench" / "fa4_carried.sh"), *args], capture_output=True, text=True,
                           env=env, timeout=60)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:") and fix in lines[0], r.stderr
    assert not (tmp_path / "parts").exists()
