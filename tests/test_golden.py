"""The golden tiny run: a refactor must leave the training math exactly where it was.

The tiny preset trains 12 steps in float64 on the tests' structured data: every schedule stage, the window changes
(YaRN), the untie and the extension. The stored file holds each step's train loss, the validation losses and a
fingerprint (sum, norm, size) of every final weight. A change that moves them on purpose re-records the file in its own
commit that says why:

    python3 tests/test_golden.py --record

Tolerances: in float64 the only machine dependence is the summation order inside BLAS and vectorised reductions,
about 1e-16 relative per operation and 1e-13 after a few steps (measured for the world-size test). The weights are
compared to 1e-9 relative; the losses to one unit of their printed last digit (6 decimals for train losses, 4 for
validation), plus a half unit for a value that lands on a rounding boundary.
"""
import json
import math
import re
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))     # when run as a script (--record)
import train_gpt as tg  # noqa: E402
from _shards import make_dataset, run_trainer  # noqa: E402

GOLDEN = Path(__file__).with_name("golden_tiny.json")
ARGS = ["--preset=tiny", "--dtype=float64", "--fp8_mlp=true", "--num_scheduled_iterations=9", "--num_extension_iterations=3",
        "--val_loss_every=4", "--train_loss_every=1", "--seed=0", "--save_checkpoint", "--run_id=golden"]


def golden_run(tmp: Path) -> dict:
    train, val = make_dataset(tmp / "d", train_tokens=400_000, val_tokens=20_000)
    p = run_trainer([*ARGS, f"--train_files={train}", f"--val_files={val}", f"--log_dir={tmp}/logs"], tmp)
    assert p.returncode == 0, p.stderr[-3000:]
    log = (tmp / "logs" / "golden.txt").read_text()
    train_loss = {int(m[1]): float(m[2]) for m in re.finditer(r"^step:(\d+)/\d+ .* train_loss:([-0-9.]+)", log, re.M)}
    val_loss = {int(m[1]): float(m[2]) for m in re.finditer(r"^step:(\d+)/\d+ val_loss:([-0-9.]+)", log, re.M)}
    steps = tg.parse_args(ARGS).num_iterations
    state = torch.load(tmp / "logs" / "golden" / f"state_step{steps:06d}.pt", weights_only=True)
    weights = {name: [w.double().sum().item(), w.double().norm().item(), w.numel()]
               for name, w in state["model"].items()}
    return {"args": ARGS, "train_loss": train_loss, "val_loss": val_loss, "weights": weights}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tiny_run_matches_the_golden_curve(tmp_path):
    golden = json.loads(GOLDEN.read_text())
    assert golden["args"] == ARGS, "the golden file was recorded with other options: re-record it"
    now = golden_run(tmp_path)
    steps = tg.parse_args(ARGS).num_iterations
    assert sorted(now["train_loss"]) == list(range(1, steps + 1))
    for kind, unit in (("train_loss", 1e-6), ("val_loss", 1e-4)):
        stored = {int(k): v for k, v in golden[kind].items()}
        assert stored.keys() == now[kind].keys(), kind
        for step, value in stored.items():
            assert abs(now[kind][step] - value) <= 1.5 * unit, (kind, step, now[kind][step], value)
    assert golden["weights"].keys() == now["weights"].keys()
    for name, (total, norm, numel) in golden["weights"].items():
        t, n, _ = now["weights"][name]
        assert math.isclose(n, norm, rel_tol=1e-9), (name, n, norm)
        # a sum can cancel to near zero: its scale is the sum of |w|, at most norm * sqrt(numel)
        assert abs(t - total) <= 1e-9 * norm * math.sqrt(numel), (name, t, total)


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        print("usage: python3 tests/test_golden.py --record   (re-records tests/golden_tiny.json)", file=sys.stderr)
        sys.exit(2)
    with tempfile.TemporaryDirectory() as tmp:
        GOLDEN.write_text(json.dumps(golden_run(Path(tmp)), indent=1) + "\n")
    print(f"wrote {GOLDEN}")
