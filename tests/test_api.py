"""The Python API is the command line: each `trtspec` command is the function of its name in `trtspec` (export-head:
trtspec.export_head), whose parameters are the command's options, by the same names and with the same defaults (a
required option: a parameter without one).

A command's "printing" options (its argument group of that name: generate's --json and --no-stream) decide how the
command shows what the function returns; the function need not take them, and where it does (generate's stream) its
default is a program's, not a terminal's.
"""

from __future__ import annotations

import argparse
import inspect

import trtspec
from trtspec.cli import build_parser

REQUIRED = object()  # a required option, a parameter without a default


def commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def options(command: argparse.ArgumentParser) -> tuple[dict, set[str]]:
    """({dest: default, or REQUIRED}, the dests of its "printing" group)."""
    found = {a.dest: REQUIRED if a.required else a.default for a in command._actions
             if a.dest != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)}
    printing = {a.dest for g in command._action_groups if g.title == "printing" for a in g._group_actions}
    return found, printing


def parameters(function) -> dict:
    return {name: REQUIRED if p.default is inspect.Parameter.empty else p.default
            for name, p in inspect.signature(function).parameters.items()}


def differences(name: str, command: argparse.ArgumentParser, function) -> list[str]:
    """What differs between ``command``'s options and ``function``'s parameters, one line each, naming the command."""
    given, printing = options(command)
    taken = parameters(function)
    cli_only = sorted(set(given) - set(taken) - printing)
    api_only = sorted(set(taken) - set(given))
    found = []
    if cli_only:
        found.append(f"trtspec {name}: options {cli_only} are not parameters of trtspec.{function.__name__}")
    if api_only:
        found.append(f"trtspec {name}: trtspec.{function.__name__}'s parameters {api_only} are not its options")
    for key in sorted((set(given) & set(taken)) - printing):
        if given[key] != taken[key]:
            show = {id(REQUIRED): "required"}
            found.append(f"trtspec {name}: {key} defaults to {show.get(id(given[key]), given[key])!r} on the command "
                         f"line, {show.get(id(taken[key]), taken[key])!r} in Python")
    return found


def test_differences_name_the_command_and_the_names():
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument("--extra")
    printing = parser.add_argument_group("printing")
    printing.add_argument("--json", action="store_true")

    def make(out, *, size=4, colour=None):
        return out

    assert differences("make", parser, make) == [
        "trtspec make: options ['extra'] are not parameters of trtspec.make",
        "trtspec make: trtspec.make's parameters ['colour'] are not its options",
        "trtspec make: size defaults to 3 on the command line, 4 in Python",
    ]


def test_every_command_is_a_function_of_trtspec_with_its_options_as_parameters():
    found = []
    for name, command in commands(build_parser()).items():
        function = getattr(trtspec, name.replace("-", "_"), None)
        if not callable(function):
            found.append(f"trtspec {name}: no function trtspec.{name.replace('-', '_')}")
            continue
        assert name.replace("-", "_") in trtspec.__all__
        found += differences(name, command, function)
    assert not found, "\n".join(found)


def test_every_command_is_there():
    assert set(commands(build_parser())) == {"export", "export-head", "quantize", "check", "build", "index", "generate",
                                             "bench", "serve", "bench-serve", "distill"}
