"""The first hour, as a newcomer lives it: a fresh clone and a fresh virtual environment, the README's "Try it on a
CPU" commands exactly as written, then a resume given only --resume=PATH, then the tools on the logs.

    python3 tests/first_hour.py [--keep=FOLDER]

Not a test the suite collects: it installs torch and the requirements from the package registries into a new
virtual environment (minutes), so it runs by hand. It prints each command with its wall time and ends with one line
per check; exit 0 when every check holds. The commands come from README.md, so an edit there is what runs here.
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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", help="work in this folder and keep it (default: a temporary folder, removed)")
    args = ap.parse_args()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="first_hour_"))
    work.mkdir(parents=True, exist_ok=True)
    log: list[str] = []
    checks: list[tuple[bool, str]] = []
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
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
    checks.append(("result: val_loss:" in train, "the CPU run ends with its result line"))
    notes = [line for line in train.splitlines() if "--dtype=auto trains in" in line]
    checks.append((len(notes) <= 1, f"at most one dtype note ({len(notes)}: {notes[:1]})"))

    # a stopped run, resumed with --resume=PATH alone: the train command again, saving states, then the resume
    train_cmd = next(c for c in readme_block("Try it on a CPU") if "train_gpt.py" in c).replace("/tmp/syn", str(syn))
    first = run(train_cmd + " --num_scheduled_iterations=6 --num_extension_iterations=2 --val_loss_every=0"
                " --checkpoint_every=4 --run_id=first_hour", repo, env, log)
    checks.append((first.returncode == 0, "a short run saves its states"))
    resumed = run(f"python3 train_gpt.py --resume={shlex.quote(str(repo / 'logs' / 'first_hour'))}"
                  " --run_id=first_hour_resumed", repo, env, log)
    out = resumed.stdout + resumed.stderr
    checks.append((resumed.returncode == 0 and "resumed from" in out,
                   "--resume=PATH alone resumes (" + (out.strip().splitlines() or ["no output"])[-1][:160] + ")"))

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
    if not args.keep:
        subprocess.run(["rm", "-rf", str(work)])
    return 0 if all(ok for ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
