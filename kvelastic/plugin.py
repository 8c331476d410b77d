"""vLLM ``general_plugins`` entry point: vLLM loads it in every process it starts.

It does nothing unless ``KVELASTIC`` is on, so merely installing kvelastic
never changes vLLM.
"""

from __future__ import annotations


def register() -> None:
    """Activate kvelastic when ``KVELASTIC`` is on; a value that is no switch stops start-up with one line."""
    from kvelastic._autopatch import enabled
    from kvelastic.errors import ConfigError

    try:
        if not enabled():
            return
    except ConfigError as error:
        from kvelastic.startup.reporting import StartupRefused

        raise StartupRefused(error) from None  # vLLM's plugin loader would show a traceback
    from kvelastic.startup.activate import activate_from_hook

    activate_from_hook()
