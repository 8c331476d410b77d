"""The words a ``KVELASTIC*`` switch accepts, defined once for every place that reads one.

Three readers share them: the settings (``KVELASTIC``, ``KVELASTIC_STRICT``),
the autopatch that runs from the ``.pth`` file, and that ``.pth`` line itself.
The line runs at every interpreter start and must import nothing while
kvelastic is off, so it cannot import this module; :func:`pth_line` writes the
off-words into it instead, and ``setup.py`` loads this file by path (it
imports nothing from kvelastic at module level) to get the line.
"""

from __future__ import annotations

from typing import Mapping

VARIABLE = "KVELASTIC"
ON = frozenset({"1", "true", "yes", "on"})
OFF = frozenset({"0", "false", "no", "off"})


def parse(name: str, text: str) -> bool:
    """``text`` as a switch named ``name``; ConfigError (naming it) for anything not on or off."""
    value = text.strip().lower()
    if value in ON:
        return True
    if value in OFF:
        return False
    from kvelastic.errors import ConfigError

    raise ConfigError(f"{name}={text!r} is not a switch: use 1 or 0 (also true/false, yes/no, on/off)")


def enabled(environ: Mapping[str, str]) -> bool:
    """Whether ``KVELASTIC`` is on in ``environ``; unset or blank is off, garbage is an error."""
    text = environ.get(VARIABLE, "")
    return bool(text.strip()) and parse(VARIABLE, text)


def pth_line() -> str:
    """The ``.pth`` line: hand every value that is not plainly off to the autopatch, which judges it.

    Off (unset, blank or an off-word) costs one environment lookup and imports
    nothing. Anything else, garbage included, reaches :func:`enabled`, so a
    misspelt switch is reported rather than silently ignored.
    """
    off = ", ".join(f'"{word}"' for word in sorted(OFF | {""}))
    return (f'import os; os.environ.get("{VARIABLE}", "").strip().lower() not in ({off}) '
            f'and __import__("kvelastic._autopatch")._autopatch.install_if_enabled()\n')
