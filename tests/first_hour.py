"""The first hour, as a newcomer lives it: a fresh clone and a fresh virtual environment, the README's "Try it on a
CPU" commands exactly as written, then a resume given only --resume=PATH, then the tools on the logs.

    python3 tests/first_hour.py [--keep=FOLDER] [--cpu_bf16=native|emulated]

Not a test the suite collects: it installs torch and the requirements from the package registries into a new
virtual environment (minutes) and trains on the CPU (minutes more), so it runs by hand. It prints each command with
its wall time and the load average, and ends with one line per check and the total time; exit 0 when every check
holds. The commands come from README.md, and the clone is of the last commit: commit an edit to have it run here.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_block(section: str) -> list[str]:
    """The commands of the first bash block under the README heading `section`, continuation lines joined."""
    text = (ROOT / "README.md").read_text()
    body = text[text.index(f"## {section}\n"):]
    block = re.search(r"```bash\n(.*?)```", body, re.S).group(1)
    return [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def run(cmd: str, cwd: Path, env: dict, log: list[str]) -> subprocess.CompletedProcess:
    t0 = time.perf_counter()
    p = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    load = os.getloadavg()[0]
    log.append(f"{took:7.1f}s  (load {load:.1f})  exit {p.returncode}  {cmd}")
    print(log[-1], flush=True)
    return p


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--keep", help="work in this folder and keep it (default: a temporary folder, removed)")
    ap.add_argument("--cpu_bf16", choices=("native", "emulated"),
                    help="set NANOGPT_CPU_BF16 for every command: the dtype --dtype=auto picks as on a CPU with "
                         "(native) or without (emulated) bf16 instructions (default: this CPU's own)")
    args = ap.parse_args()
    t_start = time.perf_counter()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="first_hour_"))
    work.mkdir(parents=True, exist_ok=True)
    log: list[str] = []
    checks: list[tuple[bool, str]] = []
    base_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("VIRTUAL_ENV", "PYTHON", "NANOGPT_CPU_BF16", "MALLOC_"))}
    if args.cpu_bf16:
        base_env["NANOGPT_CPU_BF16"] = args.cpu_bf16
    subprocess.run(["git", "clone", "-q", str(ROOT), str(work / "repo")], check=True)
    repo = work / "repo"
    subprocess.run([sys.executable, "-m", "venv", str(work / "venv")], check=True)
    env = dict(base_env, PATH=f"{work / 'venv' / 'bin'}:{base_env['PATH']}", VIRTUAL_ENV=str(work / "venv"))
    syn = work / "syn"
    outputs = []
    for cmd in readme_block("Try it on a CPU"):
        cmd = cmd.replace("/tmp/syn", str(syn))          # the README's scratch folder, kept inside this run's folder
        outputs.append(run(cmd, repo, env, log))
        if outputs[-1].returncode != 0:
            print(outputs[-1].stdout[-2000:], outputs[-1].stderr[-2000:])
            return 1
    train = outputs[-1].stdout + outputs[-1].stderr
    result = re.search(r"^result: val_loss:.*$", train, re.M)
    checks.append((result is not None, f"the CPU run ends with its result line ({result and result[0][:90]})"))
    # --dtype=auto: bf16 where the CPU has bf16 instructions, else float32 and one note that says so
    native = run('python3 -c "import checks; print(checks.cpu_runs_bf16_natively())"', repo, env, log)
    setup = re.search(r"^world_size:.* dtype:(\w+) ", train, re.M)
    want = "bfloat16" if native.stdout.strip() == "True" else "float32"
    notes = [line for line in train.splitlines() if "--dtype=auto trains in" in line]
    checks.append((setup is not None and setup[1] == want and len(notes) == (want == "float32"),
                   f"--dtype=auto on this CPU (bf16 instructions: {native.stdout.strip()}) trains in "
                   f"{setup and setup[1]} (want {want}) with {len(notes)} dtype note(s) {notes[:1]}"))

    # a stopped run, resumed with --resume=PATH alone: the train command again, saving states, then a resume of
    # its middle state, which must end with the uninterrupted run's validation loss (a CPU resumes bit for bit)
    train_cmd = next(c for c in readme_block("Try it on a CPU") if "train_gpt.py" in c).replace("/tmp/syn", str(syn))
    first = run(train_cmd + " --num_scheduled_iterations=6 --num_extension_iterations=2 --val_loss_every=0"
                " --checkpoint_every=4 --run_id=first_hour", repo, env, log)
    middle = repo / "logs" / "first_hour" / "state_step000004.pt"
    checks.append((first.returncode == 0 and middle.is_file(), f"a short run saves its states ({middle.name})"))
    resumed = run(f"python3 train_gpt.py --resume={shlex.quote(str(middle))}", repo, env, log)
    out = resumed.stdout + resumed.stderr
    losses = [re.search(r"^result: val_loss:(\S+)", p.stdout + p.stderr, re.M) for p in (first, resumed)]
    same = all(losses) and losses[0][1] == losses[1][1]
    checks.append((resumed.returncode == 0 and "after step 4 of 8" in out and same,
                   f"--resume=PATH alone continues the run to its val_loss ({[m and m[1] for m in losses]}): "
                   + (out.strip().splitlines() or ["no output"])[-1][:120]))

    # the tools, with the one install line the README gives them
    tools_install = next((c for c in readme_block("Tools") if "tools/requirements.txt" in c), None) \
        if "## Tools\n" in (ROOT / "README.md").read_text() else None
    if tools_install:
        run(tools_install, repo, env, log)
    logs = sorted((repo / "logs").glob("*.txt"))
    for tool in (f"python3 tools/runlogs.py {' '.join(map(str, logs))}",
                 f"python3 tools/stats.py {' '.join(map(str, logs))}",
                 f"python3 tools/plot.py {' '.join(map(str, logs))} --out={work / 'curves.png'}"):
        p = run(tool, repo, env, log)
        lines = (p.stdout + p.stderr).strip().splitlines()
        ok = p.returncode == 0 or (len([line for line in lines if line.startswith("error:")]) == 1
                                   and "Traceback" not in p.stderr)
        checks.append((ok, f"{tool.split()[1]}: exit {p.returncode}, {lines[-1][:120] if lines else 'no output'}"))

    print("\n".join(f"{'ok ' if ok else 'FAIL'} {what}" for ok, what in checks))
    print(f"{time.perf_counter() - t_start:.0f}s in all (load average now {os.getloadavg()[0]:.1f}, "
          f"{os.cpu_count()} CPUs)")
    if not args.keep:
        subprocess.run(["rm", "-rf", str(work)])
    return 0 if all(ok for ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
