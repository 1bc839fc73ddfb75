"""Every code block of README.md and docs/ is run or checked on a CPU.

A fence names its language: `python` blocks run, those of one page in order in one namespace
(a page reads as one session); `sh` blocks have each command checked: every `wise` command and every
`python -m MODULE` command is parsed by its own argument parser (a `wise generate` run costs
tens of seconds of a CPU; the engine tests run it), `pip`, `curl` and `bash` lines
are not run (installs, a server's client, GPU scripts), and any other program is an error;
`text` blocks are not code. A block that must not run (a GPU, a second device, a running server)
carries the marker `<!-- docs-test: skip, REASON -->` on the line before its fence. README's
test command is the one `.ci/run` runs.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LANGUAGES = ("python", "sh", "text")
SKIP = re.compile(r"^<!-- docs-test: skip, (\S.*) -->$")
FENCE = re.compile(r"^( *)```(\S*)\s*$")
NOT_RUN = {"pip": "an install", "curl": "a running server's client", "bash": "a GPU script"}
MOST_SKIPPED = 4


@dataclasses.dataclass(frozen=True)
class Block:
    page: Path
    line: int            # the opening fence's, 1-based
    language: str
    code: str
    skip: str | None     # the marker's reason, None: the block runs

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a markdown page (indented fences too)."""
    found, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, language = opening.groups()
        end = next(j for j in range(i + 1, len(lines)) if lines[j] == indent + "```")
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = SKIP.match(before)
        code = "\n".join(line[len(indent):] for line in lines[i + 1:end]) + "\n"
        found.append(Block(page, i + 1, language, code, marker.group(1) if marker else None))
        i = end + 1
    return found


def commands(code: str) -> list[list[str]]:
    """The commands of a shell block as argv lists: a command may span lines inside quotes or
    after a backslash, and `a && b` is two commands."""
    found, pending = [], ""
    for line in code.splitlines():
        pending += line + "\n"
        if pending.rstrip().endswith("\\"):
            continue
        try:
            words = shlex.split(pending.replace("\\\n", " "))
        except ValueError:   # a quoted string goes on over the next line
            continue
        pending = ""
        command = []
        for word in words + ["&&"]:
            if word == "&&":
                found += [command] if command else []
                command = []
            else:
                command.append(word)
    assert not pending.strip(), f"unterminated command: {pending!r}"
    return found


ALL_BLOCKS = [block for page in PAGES for block in blocks(page)]


def test_every_block_names_its_language_and_few_are_skipped():
    assert len(ALL_BLOCKS) > 15
    unnamed = [str(b) for b in ALL_BLOCKS if b.language not in LANGUAGES]
    assert unnamed == [], f"fences must name one of {LANGUAGES}: {unnamed}"
    skipped = [f"{b}: {b.skip}" for b in ALL_BLOCKS if b.skip]
    assert 0 < len(skipped) <= MOST_SKIPPED, skipped


def test_the_block_reader_and_the_command_splitter():
    main_job = blocks(ROOT / "README.md")[0]
    assert main_job.language == "sh" and "wise generate" in main_job.code and not main_job.skip
    assert commands('pip install a && wise generate --prompt "x\n\ny" --wise\nwise serve \\\n  --port 1\n') == [
        ["pip", "install", "a"], ["wise", "generate", "--prompt", "x\n\ny", "--wise"], ["wise", "serve", "--port", "1"]]


@pytest.mark.parametrize("page", [p for p in PAGES if any(b.language == "python" and not b.skip for b in blocks(p))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(page, capsys):
    namespace = {"__name__": "__main__"}
    for block in blocks(page):
        if block.language == "python" and not block.skip:
            exec(compile(block.code, str(block), "exec"), namespace)
    assert capsys.readouterr().out.strip(), f"{page}: the examples printed nothing"


def check_wise_command(argv: list[str]) -> None:
    from wise.cli import build_parser, check_generate_arguments
    args = build_parser().parse_args(argv[1:])
    if args.command == "generate":
        check_generate_arguments(args)


def check_module_command(argv: list[str], where: str) -> None:
    module = importlib.import_module(argv[2])
    parse = getattr(module, "build_parser", None)
    if parse is not None:
        parse().parse_args(argv[3:])
    elif hasattr(module, "parse_args"):
        module.parse_args(argv[3:])
    else:
        assert hasattr(module, "main"), f"{where}: {argv[2]} has no argument parser and no main"


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.language == "sh" and not b.skip], ids=str)
def test_shell_commands_are_valid(block):
    for argv in commands(block.code):
        if argv[0] == "wise":
            check_wise_command(argv)
        elif argv[0] in ("python", "python3") and argv[1] == "-m" and argv[2] != "pytest":
            check_module_command(argv, str(block))
        elif argv[0] in ("python", "python3") and argv[1:3] == ["-m", "pytest"]:
            continue   # README's test command: test_readme_tests_as_ci_does
        else:
            assert argv[0] in NOT_RUN, f"{block}: a command the docs test does not know: {shlex.join(argv)}"


def test_readme_tests_as_ci_does():
    """README's test command is .ci/run's: the same installs, then the same pytest command."""
    def installs_and_pytest(argvs):
        installs = [[w for w in argv[argv.index("install") + 1:] if w != "-q"] for argv in argvs if "install" in argv]
        pytest_runs = [argv[argv.index("pytest"):] for argv in argvs if "pytest" in argv]
        return installs, pytest_runs

    readme = [argvs for b in blocks(ROOT / "README.md") if b.language == "sh"
              for argvs in [commands(b.code)] if any("pytest" in argv for argv in argvs)]
    ci = [shlex.split(line, comments=True) for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    ci = [argv for argv in ci if argv and argv[0] in ("python", "python3")]
    assert len(readme) == 1
    assert installs_and_pytest(readme[0]) == installs_and_pytest(ci)
