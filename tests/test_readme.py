"""The README stays a short guide whose links and commands work: at most 300 lines of at most 100 characters (CI's
test command, which it quotes exactly, aside), every relative link (README and docs/) names an existing file, the
test command is CI's, the credits live in docs/credits.md, the trainer accepts the options of every
`python3 train_gpt.py` and `python3 my_idea.py` command it shows (the copy is train_gpt.py's), and each tool it runs
has the options it passes."""
import re
import shlex

import pytest

import train_gpt as tg
from _shards import ROOT

README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _ci_commands():
    return [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if "pytest" in line]


def test_readme_is_at_most_300_lines():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move reference material to docs/"


def test_readme_lines_are_at_most_100_characters():
    """Prose and code blocks alike; only CI's test command is exempt, as the README must quote it exactly."""
    lines = README.read_text(encoding="utf-8").splitlines()
    exact = set(_ci_commands())
    wide = [(n, len(line)) for n, line in enumerate(lines, 1) if len(line) > 100 and line not in exact]
    assert wide == [], f"README.md lines wider than 100 characters (line, width): {wide}"


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
    ci = _ci_commands()
    assert ci and all(line in README.read_text() for line in ci)


def test_the_credits_live_in_docs_credits_md():
    """The README links docs/credits.md; that page holds who introduced each idea (handles, records, pull requests)
    and the provenance, and the README no longer repeats the list."""
    readme = README.read_text(encoding="utf-8")
    assert "](docs/credits.md)" in readme, "README.md must link docs/credits.md"
    credits = " ".join((ROOT / "docs" / "credits.md").read_text(encoding="utf-8").split())  # wrapping aside
    for known in ("Keller Jordan", "@classiclarryd", "@varunneal", "@ChrisJMcCormick", "@samacqua",
                  "record 80 ([PR 253](https://github.com/KellerJordan/modded-nanogpt/pull/253))",
                  "**Provenance.**", "MIT license"):
        assert known in credits, f"docs/credits.md lacks {known!r}"
    bullets = [line for line in readme.splitlines() if line.startswith("- ") and "@" in line]
    assert bullets == [], f"credit lines in README.md (they belong in docs/credits.md): {bullets}"


def _joined():
    """The README with `\\` line ends joined, so that a wrapped command is one line."""
    return README.read_text(encoding="utf-8").replace("\\\n", " ")


def _commands(program):
    """The arguments of each README line that runs `python3 <program>` (an environment prefix such as
    TRAIN=my_idea.py allowed), its trailing comment dropped."""
    lines = re.findall(rf"^(?:[A-Z_]+=\S+ )*python3 {re.escape(program)}(?: (.*?))?(?:\s+#.*)?$", _joined(), re.M)
    return [shlex.split(line) for line in lines]


def test_the_readme_trainer_commands_parse():
    """Each `python3 train_gpt.py ...` or `python3 my_idea.py ...` command of the README (joined across `\\` line
    ends) names real options: the copy takes train_gpt.py's."""
    commands = _commands("train_gpt.py") + _commands("my_idea.py")
    assert _commands("train_gpt.py") and _commands("my_idea.py")
    for command in commands:
        tg.parse_args(command)


def test_the_copy_runs_the_cpu_command_of_train_gpt():
    """Change one idea runs the copy with Try it on a CPU's command, on the CPU whatever the machine has."""
    tiny = [c for c in _commands("train_gpt.py") if "--preset=tiny" in c]
    copy = [c for c in _commands("my_idea.py") if "--preset=tiny" in c]
    assert len(tiny) == 1 and len(copy) == 1
    assert sorted(copy[0]) == sorted(tiny[0] + ["--device=cpu"])
    assert "cp train_gpt.py my_idea.py" in README.read_text(encoding="utf-8")


@pytest.mark.parametrize("tool", ["stats", "plot", "runlogs", "repeat"])
def test_the_readme_tool_commands_name_the_tools_options(tool):
    """Each `python3 tools/<tool>.py ...` command of the README passes only options the tool's parser has; what
    follows a bare `--` (tools/repeat.py's trainer options) parses as the trainer's."""
    source = (ROOT / "tools" / f"{tool}.py").read_text(encoding="utf-8")
    known = set(re.findall(r'add_argument\(\s*"(--[a-z_]+)"', source))
    commands = _commands(f"tools/{tool}.py")
    assert commands, f"the README shows no tools/{tool}.py command"
    for command in commands:
        ours, trainer = (command[:command.index("--")], command[command.index("--") + 1:]) \
            if "--" in command else (command, [])
        unknown = [a for a in ours if a.startswith("--") and a.split("=")[0] not in known]
        assert unknown == [], f"tools/{tool}.py has no {unknown} (its options: {sorted(known)})"
        if trainer:
            tg.parse_args(trainer)


def test_the_tools_section_installs_the_tools_dependencies_in_one_line():
    """README, Tools: one command installs what tools/*.py need (tools/requirements.txt, which
    tests/test_tools_robustness.py checks against the tools' imports), and docs/tools.md gives the same line."""
    line = "python3 -m pip install -r tools/requirements.txt"
    text = README.read_text(encoding="utf-8")
    tools = text[text.index("\n## Tools\n"):].split("\n## ")[1]
    assert f"\n{line}\n" in tools, "README.md, Tools: the tools' install line, alone on a line of a code block"
    assert (ROOT / "tools" / "requirements.txt").is_file()
    assert line in (ROOT / "docs" / "tools.md").read_text(encoding="utf-8")
