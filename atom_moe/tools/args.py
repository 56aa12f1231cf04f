"""What every `atom-moe` subcommand shares on its command line: one-line errors, exit codes, value types.

Exit codes, the same for every subcommand:
  0  done;
  1  a runtime failure: a valid request this machine or server cannot carry out (no GPU,
     a server that does not answer, a budget that does not fit, a result below a threshold);
  2  a usage error: a value that is wrong whatever the machine (out of range, unknown name,
     options that contradict each other). The message names the value and what is allowed.
"""

from __future__ import annotations

import argparse
import re
import sys

USAGE, FAILURE = 2, 1


class UsageError(ValueError):
    """A bad command-line value; the message names it and what is allowed (exit 2)."""


class RunFailure(RuntimeError):
    """A valid request that cannot be carried out here (exit 1)."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump) and every option's default shown in --help."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        """Print one line naming the bad value and what is allowed, then exit 2."""
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(USAGE)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps module docstrings' line breaks and appends '(default: X)' to every option that has a value."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if re.search(r"\bdefault\b|\bnone:", text):  # the help already says what happens by default
            return text
        if action.nargs == 0:  # a switch: its default is always "off"
            return text
        default = action.default
        shown = "none" if default is None else " ".join(map(str, default)) if isinstance(default, list) else default
        return f"{text} (default: {shown})"


def _number(kind, text: str, ok, allowed: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; allowed: {allowed}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"{text!r} is out of range; allowed: {allowed}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _number(int, text, lambda v: v >= 1, "an integer >= 1")


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _number(int, text, lambda v: v >= 0, "an integer >= 0")


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    return _number(float, text, lambda v: 0 < v < float("inf"), "a number > 0")


def nonnegative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    return _number(float, text, lambda v: 0 <= v < float("inf"), "a number >= 0")


def fraction(text: str) -> float:
    """argparse type: a number in (0, 1]."""
    return _number(float, text, lambda v: 0 < v <= 1, "a number in (0, 1]")


def unit_interval(text: str) -> float:
    """argparse type: a number in [0, 1]."""
    return _number(float, text, lambda v: 0 <= v <= 1, "a number in [0, 1]")


def open_fraction(text: str) -> float:
    """argparse type: a number in [0, 1)."""
    return _number(float, text, lambda v: 0 <= v < 1, "a number in [0, 1)")
