"""Proof, from an engine's own log, that a run meant to use kvelastic really did (for the benchmark drivers).

A kvelastic run differs from a vanilla one only by ``KVELASTIC=1``; if the
package is importable but not installed (no ``.pth`` hook, no vLLM plugin entry
point), vLLM starts without it and the run measures vanilla vLLM under
kvelastic's name. A check that imports kvelastic from the repo root passes in
that case (the engine never sees it), so the benchmark drivers read the log for the line every kvelastic engine prints
when it sizes its KV cache, and fail the run without it.
"""

from __future__ import annotations

from pathlib import Path

ENGINE_MARK = "kvelastic: KV cache virtual"


def kvelastic_took_effect(log_text: str) -> bool:
    """Whether an engine in this log built its KV cache through kvelastic."""
    return ENGINE_MARK in log_text


def inactive_reason(log: Path) -> str | None:
    """Why a run meant for kvelastic does not count, or None when its log shows kvelastic at work."""
    text = log.read_text(errors="replace") if log.exists() else ""
    if kvelastic_took_effect(text):
        return None
    return (f"KVELASTIC=1 but no engine in {log} printed {ENGINE_MARK!r}: kvelastic never took effect "
            "(is it installed? python3 -m pip install --no-deps --no-build-isolation -e .)")
