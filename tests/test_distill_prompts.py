"""distill/prompts.py: the requests a target answers for its head's training data, built from a source tree and a
text file (the registry's packages are not needed here)."""

from __future__ import annotations

import pytest

from trtspec.distill.prompts import completion_chats, docstring_chats, text_chats, training_requests
from trtspec.training import DistillError

MODULE = '''\
import math


class Shape:
    @property
    def area(self) -> float:
        """The area of the shape, in square units of its own coordinates."""
        return 0.0

    def scale(self, factor: float = 2.0):
        """Scale the shape by factor about its centre, in place, and return the shape itself so calls chain."""
        return self


def hypot3(x, y, z=0.0):
    """Return the length of the vector (x, y, z).

    Uses math.hypot, which avoids overflow.
    """
    return math.hypot(x, y, z)


def _private(x):
    """A private helper with a long enough docstring to count if it were public."""


def short(x):
    """Too short."""
'''


@pytest.fixture()
def tree(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "shapes.py").write_text(MODULE)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_shapes.py").write_text(MODULE)  # test directories are left out
    (tmp_path / "broken.py").write_text("def f(:\n")  # a file that does not parse is skipped
    return tmp_path


def test_completion_requests_are_the_functions_own_lines_as_humaneval_puts_them(tree):
    got = dict(completion_chats(tree))
    assert sorted(got) == ["pkg/shapes.py:area:6", "pkg/shapes.py:hypot3:15", "pkg/shapes.py:scale:10"]
    assert got["pkg/shapes.py:area:6"] == [{"role": "user", "content": (
        'Complete this Python function:\ndef area(self) -> float:\n    """The area of the shape, in square units of '
        'its own coordinates."""\n')}]
    assert got["pkg/shapes.py:hypot3:15"][0]["content"] == (
        'Complete this Python function:\ndef hypot3(x, y, z=0.0):\n    """Return the length of the vector (x, y, z).\n'
        '\n    Uses math.hypot, which avoids overflow.\n    """\n')
    assert len(completion_chats(tree, limit=2)) == 2
    assert dict(completion_chats(tree, max_chars=60)) == {}  # every head is longer than 60 characters


def test_docstring_requests_take_the_first_paragraph_and_the_arguments(tree):
    got = dict(docstring_chats(tree))
    assert sorted(got) == ["pkg/shapes.py:area:6", "pkg/shapes.py:scale:10"]  # hypot3's first paragraph is short
    assert got["pkg/shapes.py:scale:10"][0]["content"] == (
        "Write a Python function `scale(factor)` that does the following:\nScale the shape by factor about its "
        "centre, in place, and return the shape itself so calls chain.")


def test_training_requests_mix_the_sources_and_prefix_their_names(tree, tmp_path):
    text = tmp_path / "story.txt"
    text.write_text("\n".join(f"line {i}" for i in range(24)))
    reqs = training_requests(("docstring", "completion", "text"), text=text, stdlib=tree)
    names = [n for n, _ in reqs]
    assert sorted(names) == sorted([f"docstring:{n}" for n, _ in docstring_chats(tree)]
                                   + [f"completion:{n}" for n, _ in completion_chats(tree)]
                                   + [f"text:{n}" for n, _ in text_chats(text)])
    # one of each source in turn while every source has requests left
    assert {n.split(":")[0] for n in names[:3]} == {"docstring", "completion", "text"}
    assert training_requests(("docstring", "completion", "text"), text=text, stdlib=tree) == reqs  # a fixed order
    assert training_requests(("completion",), stdlib=tree, limit=1) == [r for r in reqs if r[0].startswith(
        "completion:")][:1]
    with pytest.raises(DistillError, match=r"unknown prompt sources \['code'\]"):
        training_requests(("code",))
    with pytest.raises(DistillError, match="needs a text file"):
        training_requests(("text",))
