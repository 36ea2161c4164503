"""The docs stay honest: every `trtspec` command in a ```bash block of README.md and docs/ parses with the CLI's own
parser, every relative link resolves (files and heading anchors), and the README stays a landing page.

Parsing runs nothing: `build_parser()` only reads the options, so paths in the docs need not exist here.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

from trtspec.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("**/*.md"))]

# the pages a user needs, each one click from the README (and the heading that answers "which drafter?")
TASK_LINKS = ["docs/getting-started.md", "docs/building.md", "docs/generating.md", "docs/generating.md#choosing-a-drafter",
              "docs/serving.md", "docs/distilling.md", "docs/kernels.md", "docs/benchmarks.md", "docs/gpu.md",
              "docs/troubleshooting.md"]

FENCE = re.compile(r"^([ \t]*)(`{3,}|~{3,})[ \t]*([\w+-]*)[^\n]*\n(.*?)^\1\2[ \t]*$", re.M | re.S)
LINK = re.compile(r"(?<!\!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|"
                  r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?\s*\)|<img[^>]+src=\"([^\"]+)\"")
SHELL_OPERATORS = {"&&", "||", ";", "|", "&", "(", ")"}


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(info string's language, body) of every fenced code block."""
    return [(m.group(3).lower(), m.group(4)) for m in FENCE.finditer(text)]


def prose(text: str) -> str:
    """The text outside fenced blocks and inline code spans, where links are links."""
    text = FENCE.sub("", text)
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", text, flags=re.S)


def trtspec_commands(block: str) -> list[list[str]]:
    """Each `trtspec ...` command of a shell block as its arguments (comments dropped, continuations joined, one
    entry per command of a `&&`/`|`/`;` chain)."""
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        tokens = list(lexer)
        segment: list[str] = []
        for token in [*tokens, ";"]:
            if token in SHELL_OPERATORS:
                while segment and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", segment[0]):
                    segment.pop(0)   # FOO=bar trtspec ...
                if segment and segment[0] == "trtspec":
                    commands.append(segment[1:])
                segment = []
            else:
                segment.append(token)
    return commands


def parse_failure(args: list[str]) -> str | None:
    """None if `trtspec ARGS` parses; else why not. Asking for help does not count as parsing."""
    if "-h" in args or "--help" in args:
        return "asks for --help (show a real command)"
    try:
        build_parser().parse_args(args)
    except SystemExit as e:
        return f"the parser exits with {e.code}"
    return None


def documented_commands() -> list[tuple[str, list[str]]]:
    found = []
    for page in PAGES:
        for language, body in fenced_blocks(page.read_text()):
            if language in ("bash", "sh", "shell", "console"):
                found += [(str(page.relative_to(ROOT)), args) for args in trtspec_commands(body)]
    return found


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of a page: lower case, punctuation dropped, spaces as hyphens, a
    repeated heading numbered."""
    anchors: set[str] = set()
    for line in FENCE.sub("", markdown).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))     # a link's text only
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def broken_links(page: Path) -> list[str]:
    broken = []
    for m in LINK.finditer(prose(page.read_text())):
        target = next(g for g in m.groups() if g)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):    # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target} (no such file: {resolved.relative_to(ROOT) if ROOT in resolved.parents else resolved})")
        elif anchor and resolved.suffix == ".md" and anchor not in github_anchors(resolved.read_text()):
            broken.append(f"{target} (no heading with anchor #{anchor} in {resolved.relative_to(ROOT)})")
    return broken


def test_every_documented_trtspec_command_parses():
    commands = documented_commands()
    failures = [f"{page}: trtspec {shlex.join(args)}: {why}" for page, args in commands
                if (why := parse_failure(args))]
    assert not failures, "documented commands that do not parse:\n" + "\n".join(failures)
    # every subcommand appears somewhere, so the check covers the whole CLI and cannot pass on an empty docs tree
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    shown = {args[0] for _, args in commands if args}
    assert set(sub) <= shown, f"subcommands no ```bash block shows: {sorted(set(sub) - shown)}"


def test_the_command_check_catches_what_does_not_parse():
    block = ("trtspec build export/x -o engines/x --backend onnxruntime   # a comment\n"
             "trtspec generate --target engines/x \\\n    --prompt 'a # not a comment' --no-such-option\n"
             "make setup && TRTSPEC_API_KEY=k trtspec serve --target engines/x --port nine\n"
             "trtspec build --help\n")
    commands = trtspec_commands(block)
    assert commands == [["build", "export/x", "-o", "engines/x", "--backend", "onnxruntime"],
                        ["generate", "--target", "engines/x", "--prompt", "a # not a comment", "--no-such-option"],
                        ["serve", "--target", "engines/x", "--port", "nine"],
                        ["build", "--help"]]
    assert [parse_failure(args) is None for args in commands] == [True, False, False, False]


def test_every_relative_link_resolves():
    broken = {str(page.relative_to(ROOT)): links for page in PAGES if (links := broken_links(page))}
    assert not broken, f"broken links: {broken}"


def test_the_link_check_catches_missing_files_and_anchors(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "other.md").write_text("# A page\n\n## Choosing a drafter: `suffix`, or a model?\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md) [ok](other.md#choosing-a-drafter-suffix-or-a-model) [ok](#top)\n"
                    "[gone](missing.md) [bad anchor](other.md#nowhere) `[in code](missing.md)`\n\n# Top\n"
                    "```bash\n[in a block](missing-too.md)\n```\n[web](https://example.com)\n")
    assert broken_links(page) == ["missing.md (no such file: missing.md)",
                                  "other.md#nowhere (no heading with anchor #nowhere in other.md)"]


def test_the_readme_is_a_landing_page():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; the limit is 250 (move detail to docs/)"
    history = [f"{i}: {line}" for i, line in enumerate(lines, 1) if re.search(r"\bissues?\s*#?\d", line, re.I)]
    assert not history, "README lines that refer to an issue:\n" + "\n".join(history)
    links = {next(g for g in m.groups() if g) for m in LINK.finditer(prose(text))}
    missing = [link for link in TASK_LINKS if link not in links]
    assert not missing, f"README does not link these docs pages: {missing}"


@pytest.mark.parametrize("page", sorted(DOCS.glob("**/*.md")), ids=lambda p: str(p.relative_to(DOCS)))
def test_docs_name_topics_not_issue_numbers(page):
    hits = [f"{i}: {line}" for i, line in enumerate(page.read_text().splitlines(), 1)
            if re.search(r"\bissues?\s*#?\d", line, re.I)]
    assert not hits, f"{page.relative_to(ROOT)} refers to issue numbers (name the topic instead):\n" + "\n".join(hits)
