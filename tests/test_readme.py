"""The README stays a short guide whose links and commands work: at most 300 lines of at most 120 characters, every
relative link (README and docs/) names an existing file, the test command is CI's, and the trainer accepts the
options of every `python3 train_gpt.py` command it shows."""
import re
import shlex

import pytest

import train_gpt as tg
from _shards import ROOT

README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_readme_is_at_most_300_lines_of_at_most_120_characters():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move reference material to docs/"
    wide = [(n, len(line)) for n, line in enumerate(lines, 1) if len(line) > 120]
    assert wide == [], f"README.md lines wider than 120 characters (line, width): {wide}"


def _anchors(path):
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", path.read_text(encoding="utf-8"), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_points_to_an_existing_file(page):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):                  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(target)
    assert broken == [], f"{page.name}: links to nothing: {broken}"


def test_readme_test_command_is_what_ci_runs():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if "pytest" in line]
    assert ci and all(line in README.read_text() for line in ci)


def test_the_readme_trainer_commands_parse():
    """Each `python3 train_gpt.py ...` command of the README (joined across `\\` line ends) names real options."""
    text = README.read_text(encoding="utf-8").replace("\\\n", " ")
    commands = re.findall(r"^python3 train_gpt\.py (.+?)(?:\s+#.*)?$", text, re.M)
    assert commands
    for command in commands:
        tg.parse_args(shlex.split(command))
