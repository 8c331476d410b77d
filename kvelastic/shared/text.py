"""Untrusted text on a terminal: a name read from a shared file must not be able to drive it."""

from __future__ import annotations

import unicodedata


def printable(text: str) -> str:
    """``text`` with control and format characters (terminal escapes, bidi overrides) shown as '?'."""
    return "".join("?" if unicodedata.category(c).startswith("C") else c for c in text)
