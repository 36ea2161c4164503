"""Argument parsing of `trtspec` (parse only: nothing is loaded or run)."""

from __future__ import annotations

import argparse
import re

import pytest

from trtspec.cli import build_parser

REQUIRED = {"generate": ["--target", "t", "--prompt", "p"], "serve": ["--target", "t"]}


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_k_policy_is_one_flag_with_one_default(command):
    parser = build_parser()
    args = parser.parse_args([command, *REQUIRED[command]])
    assert args.k_policy == "load-aware" and args.num_draft_tokens == 4
    args = parser.parse_args([command, *REQUIRED[command], "--k-policy", "fixed", "-k", "6"])
    assert args.k_policy == "fixed" and args.num_draft_tokens == 6


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("bad", [["--adaptive-k"], ["--k-policy", "adaptive"]])
def test_adaptive_k_and_unknown_policies_are_refused(command, bad, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([command, *REQUIRED[command], *bad])
    assert exc.value.code == 2
    assert bad[0] in capsys.readouterr().err


def test_generate_and_serve_share_their_engine_arguments():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices

    def engine_options(command):
        return {(tuple(a.option_strings), a.default, tuple(a.choices or ()), a.help)
                for a in sub[command]._actions
                if a.dest in ("target", "draft", "drafter", "num_draft_tokens", "k_policy", "threads", "datastore")}

    assert len(engine_options("generate")) == 7
    assert engine_options("generate") == engine_options("serve")


def test_the_cli_offers_the_schedulers_k_policies():
    from trtspec import cli
    from trtspec.runtime.scheduler import K_POLICIES

    assert cli.K_POLICIES == K_POLICIES


def test_serve_bounds_queue_body_and_headers_by_default_as_the_server_does():
    from trtspec.server.app import MAX_BODY_BYTES, MAX_QUEUE
    from trtspec.server.run import HEADER_TIMEOUT

    args = build_parser().parse_args(["serve", *REQUIRED["serve"]])
    assert (args.max_queue, args.max_body_bytes, args.header_timeout) == (MAX_QUEUE, MAX_BODY_BYTES, HEADER_TIMEOUT)
    assert not args.metrics_public and not args.parse_special_tokens


def test_serve_takes_one_api_key_source_on_its_command_line(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", *REQUIRED["serve"], "--api-key", "a", "--api-key-file", "keys"])
    assert exc.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def _option_helps():
    """(command, option, help as `--help` prints it) for every option of every subcommand."""
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices
    for command, p in [("trtspec", parser), *sub.items()]:
        formatter = p._get_formatter()
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction) or "-h" in action.option_strings:
                continue
            yield command, "/".join(action.option_strings) or action.dest, formatter._expand_help(action)


def test_help_reads_as_a_reference_one_short_line_per_option_with_its_default():
    flags = (argparse._StoreTrueAction, argparse._StoreFalseAction)
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices
    unstated = [f"{name} {a.option_strings[0]}" for name, p in sub.items() for a in p._actions
                if a.option_strings and not a.required and not isinstance(a, (*flags, argparse._HelpAction))
                and "default" not in p._get_formatter()._expand_help(a)]
    assert not unstated, f"options whose help states no default: {unstated}"
    helps = list(_option_helps())
    assert len(helps) > 100
    missing = [f"{c} {o}" for c, o, h in helps if not h.strip()]
    assert not missing, f"options without help: {missing}"
    long = [f"{c} {o}: {len(h)} characters" for c, o, h in helps if len(h) > 130]
    assert not long, f"help longer than a line or two (move the detail to docs/): {long}"


def test_help_holds_no_measured_figures():
    measured = re.compile(r"\d(\.\d+)?x\b|tok/s|\d\s*ms\b|\bfaster\b \w* ?(than|on)|measured on|here\)")
    found = [f"{c} {o}: {h}" for c, o, h in _option_helps() if measured.search(h)]
    assert not found, f"help strings with measured figures (they belong in docs/): {found}"
    # the check sees a figure where there is one
    assert measured.search("1.16x faster decode on SmolLM2 here)") and measured.search("10.9 ms a call")
