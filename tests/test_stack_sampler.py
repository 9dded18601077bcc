"""bench/stack_sampler.py: runs a script with its arguments and exit code, and reports the functions that were on
its main thread's stack, each nested inside its caller."""
import sys

from _shards import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import stack_sampler  # noqa: E402

SCRIPT = '''
import sys, time

def spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass

def outer():
    spin(0.3)

outer()
sys.exit(int(sys.argv[1]))
'''


def test_reports_the_scripts_functions_and_keeps_its_exit_code(tmp_path, monkeypatch):
    script = tmp_path / "work.py"
    script.write_text(SCRIPT)
    out = tmp_path / "stacks.txt"
    monkeypatch.setattr(sys, "argv", list(sys.argv))          # the sampler sets the script's argv
    code = stack_sampler.main([f"--out={out}", "--interval_ms=2", "--", str(script), "3"])
    assert code == 3
    inclusive = {}
    for line in out.read_text().splitlines()[2:]:
        if not line.strip():
            break
        total, own, name = line.split(maxsplit=2)
        inclusive[name.split(" (")[0]] = (float(total.rstrip("s")), float(own.rstrip("s")))
    # every sample inside spin is inside outer too; the script's own frame holds both
    assert inclusive["outer"][0] >= inclusive["spin"][0] > 0
    # outer only calls spin: its own time is at most the odd sample taken between the two frames
    assert inclusive["outer"][1] <= 0.1 * inclusive["outer"][0]
    assert inclusive["<module>"][0] >= inclusive["outer"][0]
