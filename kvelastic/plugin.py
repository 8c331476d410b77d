"""vLLM ``general_plugins`` entry point: vLLM loads it in every process it starts.

It does nothing unless ``KVELASTIC`` is on, so merely installing kvelastic
never changes vLLM.
"""

from __future__ import annotations


def register() -> None:
    from kvelastic._autopatch import enabled

    if not enabled():
        return
    from kvelastic.startup.activate import activate_from_hook

    activate_from_hook()
