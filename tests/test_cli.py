"""The `segue` command line: flag errors are reported like argparse's, not as tracebacks, and every
flag has help text."""
from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from segue.cli import build_parser, main


@pytest.mark.parametrize("flag, value, message", [
    ("--latency-capacity-tokens", "0", "latency_capacity_tokens must be >= 1"),
    ("--watermark", "2", "watermark must be in [0, 1)"),
])
def test_bad_engine_flag_is_a_clear_cli_error(capsys, flag, value, message):
    with pytest.raises(SystemExit) as exc:
        main(["--log-level", "WARNING", "generate", flag, value, "hi"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def _options_without_help(parser: argparse.ArgumentParser, command: str) -> Iterator[str]:
    for action in parser._actions:  # argparse offers no public walk over a parser's actions
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options_without_help(sub, f"{command} {name}")
        elif action.option_strings and not action.help:
            yield f"{command} {'/'.join(action.option_strings)}"


def test_every_cli_option_has_help():
    """`segue ... --help` explains every flag, in every subcommand (bench and sim included)."""
    assert list(_options_without_help(build_parser(), "segue")) == []
