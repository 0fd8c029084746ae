"""The README and docs/ say only what this repository can do: every `flexdraft` command they show parses with the
real CLI parser, every repository path they name or link exists, and none points outside the repository."""
import re
import shlex
from pathlib import Path

import pytest

from flexdraft.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LIBRARY = ROOT / "platform" / "flexdraft"
# the repository's folders and the library's (docs name library modules from its root, e.g. `engine/engine.py`)
FOLDERS = sorted({p.name for p in [*ROOT.iterdir(), *LIBRARY.iterdir()] if p.is_dir() and not p.name.startswith(("_", "."))})


def commands(text: str) -> list[str]:
    """`flexdraft ...` lines of shell blocks (continuations joined, comments and pipes cut) and inline code."""
    found = []
    for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", text, re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = line.strip().removeprefix("$ ")
            if line.startswith("flexdraft "):
                found.append(line)
    found += re.findall(r"`(flexdraft [^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    cut = lambda c: re.split(r"\s+#\s|\s+(?:\||&&|>|;)\s", c)[0].removesuffix(" ...").strip()
    return [cut(c) for c in found]


def test_every_flexdraft_command_in_the_docs_parses():
    """Each command a reader may copy parses: a subcommand that exists, flags it has, values of the right type
    (a bare command name, e.g. "`flexdraft cluster`" in prose, is a reference and may stand alone)."""
    subcommands = set(build_parser()._subparsers._group_actions[0].choices)
    checked, bad = 0, []
    for doc in DOCS:
        for command in commands(doc.read_text()):
            argv = shlex.split(command)[1:]
            if len(argv) == 1 and argv[0] in subcommands:
                continue
            try:
                build_parser().parse_args(argv)
                checked += 1
            except SystemExit:
                bad.append(f"{doc.relative_to(ROOT)}: {command}")
    assert not bad, "commands the CLI does not take:\n" + "\n".join(bad)
    assert checked > 40  # the extraction finds the docs' commands (README alone shows ~25)


def test_every_path_the_docs_name_exists_and_none_points_outside_the_repository():
    """Relative links resolve from the document's folder, backticked paths from the repository's or the library's
    root; no
    document names a machine path (/work, /home) or a folder beside the repository (../shared)."""
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if not re.match(r"[a-z]+://|mailto:", target) and not (doc.parent / target).exists():
                missing.append(f"{doc.relative_to(ROOT)}: link {target}")
        for path in re.findall(r"`((?:%s)/[^`\s*<>{}$]*)`" % "|".join(FOLDERS), text):
            if not any((root / path.rstrip(".,:")).exists() for root in (ROOT, LIBRARY)):
                missing.append(f"{doc.relative_to(ROOT)}: path {path}")
        for outside in re.findall(r"\.\./shared|/work/\S*|/home/\S*", text):
            missing.append(f"{doc.relative_to(ROOT)}: outside the repository: {outside}")
    assert not missing, "\n".join(missing)
