"""Are two saved training states bit for bit the same?  python3 bench/compare_states.py A.pt B.pt

Compares what decides the rest of a run (weights, optimizer state, pending gradients, data position, RNG, step) and
prints one line per part, with the largest difference of the weights that differ. Exit 0 when all are equal, else 1;
2 with one error line for a file that is not a whole training state or whose seal does not match (as --resume).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PARTS = ("model", "optimizer", "grads", "loader", "rng", "step")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("error: give two state files: python3 bench/compare_states.py A.pt B.pt", file=sys.stderr)
        return 2
    import torch
    import train_gpt as tg
    import harness
    try:      # each seal checked as --resume checks it: a damaged state is said, not compared
        a, b = (harness.read_sealed_state(path, PARTS) for path in argv)
    except harness.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    equal = True
    for part in PARTS:
        same = harness.states_equal(a[part], b[part])
        equal &= same
        print(f"{part:10s} {'bitwise equal' if same else 'DIFFERENT'}")
        if part == "model" and not same:
            for name, x in a["model"].items():
                y = b["model"][name]
                if not torch.equal(x, y):
                    print(f"    {name}: max |a-b| = {(x.double() - y.double()).abs().max().item():.3e}")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
