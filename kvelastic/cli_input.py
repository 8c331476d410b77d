"""What the ``kvelastic`` command accepts, and the one-line refusal (exit 2) of what it does not.

Sizes (:func:`parse_max`, :func:`parse_limit`), refresh periods
(:func:`seconds_argument`), GPU ids (:func:`check_gpu_text`) and negative
sizes that argparse would take for options (:func:`negative_size`): every bad
value ends in a :class:`CliError` naming the argument and what it accepts,
never in a traceback.
"""

from __future__ import annotations

import argparse
import math
import re
from typing import Sequence

from kvelastic.errors import ConfigError
from kvelastic.settings import CHUNK_GRANULE
from kvelastic.shared.text import printable
from kvelastic.units import SIZE_FORM, format_size, parse_size

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_UNKNOWN = 3
EXIT_NONE = 4
EXIT_DENIED = 5
EXIT_CORRUPT = 6
EXIT_PIPE_CLOSED = 141  # 128 + SIGPIPE, what a shell reports for a tool the signal stopped
_CLEAR_WORDS = {"none", "off", "unlimited"}  # a min of 0
_RESTORE_WORDS = {"none", "reset", "default"}  # a max: the start-up cap
_UNCAPPED_WORDS = {"off", "unlimited"}  # a max: refused, an engine never runs without its cap
RESTORE_START_CAP = -1  # parse_max's answer for "put back the start-up cap"
_NEGATIVE = re.compile(r"-\.?[0-9]")  # a token argparse would read as an option, meant as a negative size


class CliError(Exception):
    """A failure the CLI reports on stderr and turns into an exit code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


MAX_INTERVAL_S = 86400.0  # a refresh period longer than a day is a typo, and time.sleep refuses huge ones


def seconds_argument(text: str) -> float:
    """A refresh period for argparse: finite seconds above zero, at most a day (``nan``, ``inf`` refused)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_INTERVAL_S:  # NaN fails every comparison
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0 and at most "
                                         f"{MAX_INTERVAL_S:g} (for example 2 or 0.5)")
    return value


def check_gpu_text(text: str, what: str) -> str:
    """CliError(2) for a GPU argument that names nothing (empty or blanks); the text otherwise."""
    if not text.strip():
        raise CliError(f"kvelastic: {what} {text!r} is empty: give a GPU id as `kvelastic status` shows it, "
                       f"an nvidia-smi UUID or an index", EXIT_USAGE)
    return text


def negative_size(argv: Sequence[str]) -> CliError | None:
    """A precise CliError(2) for ``budget -5GiB`` and the like, which argparse would take for an unknown option."""
    if argv[:1] not in (["budget"], ["limit"]):
        return None
    for before, token in zip(argv, argv[1:]):
        if token == "--":
            return None
        if _NEGATIVE.match(token):
            argument = before if before in ("--min", "--max") else "SIZE" if argv[0] == "budget" else "MAX"
            also = "; or 'none'" if argv[0] == "limit" else ""
            return CliError(f"kvelastic {argv[0]}: {argument}={printable(token)!r} is a negative size: sizes are "
                            f"zero or more, {SIZE_FORM}{also}", EXIT_USAGE)
    return None


def parse_limit(text: str | None, argument: str) -> int | None:
    """Bytes from a min argument; 'none' is 0; None stays None. CliError(2) on garbage."""
    if text is None:
        return None
    if text.strip().lower() in _CLEAR_WORDS:
        return 0
    return _size(text, argument)


def parse_max(text: str | None, argument: str) -> int | None:
    """Bytes from a max argument; 'none' is RESTORE_START_CAP; None stays None. CliError(2) otherwise.

    'off', 'unlimited' and 0 used to remove the cap; they are refused rather
    than silently meaning something else, since an engine always keeps one.
    """
    if text is None:
        return None
    word = text.strip().lower()
    if word in _RESTORE_WORDS:
        return RESTORE_START_CAP
    nbytes = None if word in _UNCAPPED_WORDS else _size(text, argument)
    if not nbytes:  # 0 is how the account spells "no cap of its own"
        raise CliError(f"kvelastic limit: {argument}={text!r}: an instance cannot run without a cap; "
                       f"'none' restores the cap it started with, a size sets a new one", EXIT_USAGE)
    check_one_chunk(nbytes, f"kvelastic limit: {argument}={text!r}")
    return nbytes


def check_one_chunk(nbytes: int, what: str) -> None:
    """CliError(2) for a size below the smallest chunk any instance maps: it could not hold one page."""
    if nbytes < CHUNK_GRANULE:
        raise CliError(f"{what} is smaller than one chunk (at least {format_size(CHUNK_GRANULE)}, "
                       f"KVELASTIC_CHUNK_SIZE, 8.00 MiB by default): not even one page would fit", EXIT_USAGE)


def _size(text: str, argument: str) -> int:
    try:
        return parse_size(text, name=argument)
    except ConfigError as error:
        raise CliError(f"kvelastic limit: {error}; or 'none'", EXIT_USAGE) from None
