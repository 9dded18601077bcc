"""Line counts of a trainer file: total, per top-level section, lines inside raise statements, where GPT starts.

    python3 notes/2026-12-01_reading_path/measure.py train_gpt.py [checks.py ...]
Sections are the file's `# N. Title` banner comments. Reads only the given files (no project import)."""
import ast
import re
import sys


def measure(path: str) -> None:
    text = open(path).read()
    lines = text.split("\n")
    tree = ast.parse(text)
    raising = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise):
            raising.update(range(node.lineno, node.end_lineno + 1))
    gpt = next((n.lineno for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GPT"), None)
    print(f"{path}: {len(lines)} lines, {len(raising)} inside raise statements, class GPT at line {gpt}")
    starts = [(i, l) for i, l in enumerate(lines) if re.match(r"^# \d+\. ", l)]
    for k, (i, title) in enumerate(starts):
        end = starts[k + 1][0] - 1 if k + 1 < len(starts) else len(lines)
        print(f"  {end - i + 2:5d}  {title[2:]}")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        measure(p)
