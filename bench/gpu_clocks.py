"""Each GPU's clock and power while it trained, from an nvidia-smi log: is a GPU held back by its power cap, and
does one run slower than the others?

    nvidia-smi --query-gpu=index,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \\
        --format=csv,noheader,nounits -lms 200 > clocks.csv &      # during the run (bench/run.sh rank8 does this)
    python3 bench/gpu_clocks.py clocks.csv [--min_watts=300]

Only samples drawing at least --min_watts count (a GPU that is compiling, validating or waiting draws less). A line
per GPU: the samples counted, the median and mean SM clock, the median power, the share of samples throttled by the
power cap (throttle reason bits 0x4 software, 0x8 hardware), the highest temperature.
"""
from __future__ import annotations

import argparse
import statistics
import sys

POWER_CAP_BITS = 0x4 | 0x8   # clocks_throttle_reasons: SW power cap, HW slowdown


def read_samples(path: str) -> dict[int, list[tuple[float, float, float, int]]]:
    """{gpu index: [(SM MHz, watts, degrees C, throttle bits), ...]} from nvidia-smi's csv,noheader,nounits lines;
    lines that do not parse (a field "[N/A]", a cut-off last line) are skipped."""
    samples: dict[int, list[tuple[float, float, float, int]]] = {}
    with open(path) as f:
        for line in f:
            fields = [x.strip() for x in line.split(",")]
            try:
                index, clock, watts, temp, reasons = fields
                samples.setdefault(int(index), []).append((float(clock), float(watts), float(temp),
                                                           int(reasons, 16)))
            except ValueError:
                continue
    return samples


def summary(samples: dict[int, list[tuple[float, float, float, int]]], min_watts: float) -> list[str]:
    lines = []
    for index in sorted(samples):
        busy = [s for s in samples[index] if s[1] >= min_watts]
        if not busy:
            lines.append(f"gpu{index}: no sample at {min_watts:g} W or more (of {len(samples[index])})")
            continue
        clocks = [s[0] for s in busy]
        capped = sum(1 for s in busy if s[3] & POWER_CAP_BITS)
        lines.append(f"gpu{index}: {len(busy)} samples at {min_watts:g} W or more: SM clock median "
                     f"{statistics.median(clocks):.0f} MHz, mean {statistics.fmean(clocks):.0f}; power median "
                     f"{statistics.median(s[1] for s in busy):.0f} W; power-capped in {100 * capped / len(busy):.0f}%; "
                     f"up to {max(s[2] for s in busy):.0f} C")
    return lines


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", help="nvidia-smi's log (the query above)")
    ap.add_argument("--min_watts", type=float, default=300.0, help="count only samples drawing this much")
    args = ap.parse_args(argv)
    try:
        samples = read_samples(args.csv)
    except OSError as e:
        print(f"error: cannot read {args.csv}: {e.strerror}; pass nvidia-smi's log", file=sys.stderr)
        return 1
    if not samples:
        print(f"error: no sample lines in {args.csv}; log with --format=csv,noheader,nounits and the query above",
              file=sys.stderr)
        return 1
    print("\n".join(summary(samples, args.min_watts)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
