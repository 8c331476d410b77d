"""kvelastic's settings, read once from ``KVELASTIC_*`` environment variables.

Every variable is validated here, and a bad value stops start-up with a
message that names the variable and the accepted form, before vLLM is touched.
A ``KVELASTIC_*`` name that no part of kvelastic reads is most likely a typo
(``KVELASTIC_LIMT``) that would silently mean "default", so
:func:`unknown_variables` names it with the nearest real name.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from dataclasses import dataclass, fields
from typing import Callable, Mapping

from kvelastic import switch
from kvelastic.errors import ConfigError
from kvelastic.shared import location
from kvelastic.shared.names import INSTANCE_NAME_FORM, is_instance_name
from kvelastic.units import format_size, parse_size

MIB = 1024 * 1024
CHUNK_GRANULE = 2 * MIB  # the CUDA allocation granularity: every chunk is a multiple of it
PREFIX = "KVELASTIC_"
#: ``KVELASTIC_*`` variables read outside :class:`Settings` (launcher, tests, CI).
OTHER_VARIABLES = ("KVELASTIC_LAUNCH_NO_GPU", "KVELASTIC_VLLM_SRC_CACHE",
                   "KVELASTIC_REQUIRE_VLLM", "KVELASTIC_DROP_VENVS", "KVELASTIC_BAND_A", "KVELASTIC_VENV",
                   "KVELASTIC_VENV_BAND_A", "KVELASTIC_BAND_C", "KVELASTIC_VENV_BAND_C",
                   "KVELASTIC_BAND_D", "KVELASTIC_VENV_BAND_D")
_ASCII_DIGITS = re.compile(r"[0-9]+")


def _seconds(name: str, text: str) -> float:
    """Finite seconds, 0 or more: ``inf`` is refused (a value that never lapses is a large number, said so)."""
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not a number of seconds (for example 10 or 0.5)") from None
    if not 0 <= value < math.inf:  # NaN fails too
        raise ConfigError(f"{name}={text!r} must be a finite number of seconds, 0 or more (for a time that in "
                          f"practice never comes, write a large one, such as 86400 for a day)")
    return value


def _switch_interval(name: str, text: str) -> float | None:
    if text.strip().lower() == "none":
        return None  # leave Python's own (0.005 s unless the application changed it)
    value = _seconds(name, text)
    if not 0 < value <= 1:
        raise ConfigError(f"{name}={text!r} must be above 0 and at most 1 second (for example 0.0002), "
                          f"or none to keep Python's own (0.005)")
    return value


def _chunk(name: str, text: str) -> int:
    value = parse_size(text, name=name)
    if value <= 0 or value % (2 * MIB):
        raise ConfigError(f"{name}={text!r} must be a positive multiple of 2MiB (for example 2MiB, 8MiB, 32MiB)")
    return value


def _size(name: str, text: str) -> int:
    value = parse_size(text, name=name)
    if value <= 0:
        raise ConfigError(f"{name}={text!r} must be larger than zero")
    return value


def _port(name: str, text: str) -> int:
    # Not str.isdigit(): it accepts '²' and other digits int() refuses or reads differently.
    value = text.strip()
    if not _ASCII_DIGITS.fullmatch(value) or not 0 < int(value) < 65536:
        raise ConfigError(f"{name}={text!r} is not a TCP port: expected a number from 1 to 65535")
    return int(value)


def _choice(*options: str) -> Callable[[str, str], str]:
    def parse(name: str, text: str) -> str:
        value = text.strip().lower()
        if value not in options:
            raise ConfigError(f"{name}={text!r} is not one of: {', '.join(options)}")
        return value

    return parse


def _name(name: str, text: str) -> str:
    """An instance name: ASCII only, so it fits its account record whole and matches itself there."""
    value = text.strip()
    if not is_instance_name(value):
        raise ConfigError(f"{name}={text!r} must be {INSTANCE_NAME_FORM}")
    return value


@dataclass(frozen=True)
class Settings:
    """Validated settings. Field metadata names the environment variable of each."""

    enabled: bool = False
    strict: bool = True
    chunk_bytes: int = 8 * MIB  # chosen from vLLM throughput on the GPU: docs/chunk-size.md
    virtual_bytes: int | None = None
    limit_bytes: int | None = None
    reserve_bytes: int = 256 * MIB
    prefetch_bytes: int = 1024 * MIB
    cache_ttl_s: float = 10.0
    #: Python's thread switch interval in the processes that hold a KV pool (None: Python's own, 5 ms).
    #: Their mapper and upkeep threads make runs of driver calls, each of which must win the GIL back from
    #: vLLM's busy loop; CPython hands it over after at most this long. On an H200 (docs/pool.md)
    #: a 32-tensor group map beside a Python-busy thread took 326 ms at 5 ms, 64 at 1 ms and
    #: 14 at 0.2 ms (1.0 alone), and an idle engine's 16k-token 8B reload 80.9 ms, 68.8 and 64.6.
    switch_interval_s: float | None = 0.0002
    cpu_bytes: int | None = None
    cpu_policy: str = "arc"
    name: str | None = None
    min_bytes: int = 0
    port: int = 0
    shared_budget_bytes: int | None = None
    shared_dir: str = location.DEFAULT_DIR
    shared_group: int | None = None  # gid whose members share accounts (unset: only this uid)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for field in fields(cls):
            variable, parse = _VARIABLES[field.name]
            text = env.get(variable)
            if text is not None and text.strip() != "":
                values[field.name] = parse(variable, text)
        settings = cls(**values)  # type: ignore[arg-type]
        _check_together(settings, env)
        return settings

    @staticmethod
    def variables() -> dict[str, str]:
        """Variable name -> field name, for documentation and the CLI."""
        return {variable: field for field, (variable, _) in _VARIABLES.items()}


def _check_together(settings: Settings, env: Mapping[str, str]) -> None:
    """Refuse sizes that are valid alone but cannot work with the chunk size (or each other)."""
    chunk = settings.chunk_bytes
    for field_name in ("limit_bytes", "virtual_bytes", "shared_budget_bytes"):
        value = getattr(settings, field_name)
        if value is not None and value < chunk:
            variable = _VARIABLES[field_name][0]
            raise ConfigError(f"{variable}={env.get(variable)!r} is smaller than one chunk "
                              f"({_chunk_text(chunk)}, KVELASTIC_CHUNK_SIZE): not even one page could be "
                              f"mapped; use at least {_chunk_text(chunk)}")
    if settings.limit_bytes is not None and settings.virtual_bytes is not None and \
            settings.limit_bytes > settings.virtual_bytes:
        raise ConfigError(f"KVELASTIC_LIMIT={env.get('KVELASTIC_LIMIT')!r} is larger than KVELASTIC_VIRTUAL_BYTES="
                          f"{env.get('KVELASTIC_VIRTUAL_BYTES')!r}: the cache can never map more than its virtual "
                          f"size; lower the limit or raise the virtual size")
    if settings.limit_bytes is not None and settings.min_bytes > settings.limit_bytes:
        raise ConfigError(f"KVELASTIC_MIN={env.get('KVELASTIC_MIN')!r} is larger than "
                          f"KVELASTIC_LIMIT={env.get('KVELASTIC_LIMIT')!r}: a reservation must fit under the cap")


def _chunk_text(nbytes: int) -> str:
    return f"{nbytes // MIB}MiB"


def known_variables() -> tuple[str, ...]:
    """Every ``KVELASTIC*`` variable some part of kvelastic reads."""
    return tuple(variable for variable, _ in _VARIABLES.values()) + OTHER_VARIABLES


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """One warning per ``KVELASTIC_*`` variable that nothing reads: a retired one (:data:`RETIRED`) says
    what kvelastic does now, any other names the nearest real one. Neither stops start-up: a retired
    variable left in a deployment's environment means what kvelastic does anyway, or close to it."""
    env = os.environ if environ is None else environ
    known = known_variables()
    suffixes = {v[len(PREFIX):]: v for v in known if v.startswith(PREFIX)}
    warnings = []
    for variable in sorted(v for v in env if v.startswith(PREFIX) and v not in known):
        if variable in RETIRED:
            warnings.append(f"{variable} is retired and ignored: {RETIRED[variable]}")
            continue
        nearest = difflib.get_close_matches(variable[len(PREFIX):], suffixes, n=1, cutoff=0.6)
        hint = f"did you mean {suffixes[nearest[0]]}?" if nearest else "settings: " + ", ".join(Settings.variables())
        warnings.append(f"{variable} is not a kvelastic setting and is ignored; {hint}")
    return warnings


#: Shown on the start-up line even at their defaults: what an operator looks for first.
ALWAYS_DESCRIBED = ("chunk_bytes", "limit_bytes", "name", "shared_budget_bytes")


def describe(settings: Settings, environ: Mapping[str, str] | None = None) -> str:
    """The settings on one short line, ``VARIABLE=value``: those set in the environment (marked ``*``) and
    :data:`ALWAYS_DESCRIBED`; every vLLM process logs it, so the other defaults are left out."""
    env = os.environ if environ is None else environ
    parts = []
    for field in fields(Settings):
        variable, _ = _VARIABLES[field.name]
        given = bool((env.get(variable) or "").strip())
        if variable == "KVELASTIC" or not (given or field.name in ALWAYS_DESCRIBED):
            continue
        value = getattr(settings, field.name)
        if value is None or (field.name == "port" and not value):  # port 0: none given
            shown = "none"
        elif isinstance(value, bool):
            shown = "1" if value else "0"
        elif field.name.endswith("_bytes"):
            shown = format_size(value).replace(" ", "")
        else:
            shown = f"{value:g}" if isinstance(value, float) else str(value)
        parts.append(f"{variable}={shown}{'*' if given else ''}")
    return " ".join(parts)


_VARIABLES: dict[str, tuple[str, Callable[[str, str], object]]] = {
    "enabled": (switch.VARIABLE, switch.parse),
    "strict": ("KVELASTIC_STRICT", switch.parse),
    "chunk_bytes": ("KVELASTIC_CHUNK_SIZE", _chunk),
    "virtual_bytes": ("KVELASTIC_VIRTUAL_BYTES", _size),
    "limit_bytes": ("KVELASTIC_LIMIT", _size),
    "reserve_bytes": ("KVELASTIC_RESERVE", lambda n, t: parse_size(t, name=n)),
    "prefetch_bytes": ("KVELASTIC_PREFETCH", lambda n, t: parse_size(t, name=n)),
    "cache_ttl_s": ("KVELASTIC_CACHE_TTL", _seconds),
    "switch_interval_s": ("KVELASTIC_SWITCH_INTERVAL", _switch_interval),
    "cpu_bytes": ("KVELASTIC_CPU_BYTES", _size),
    "cpu_policy": ("KVELASTIC_CPU_POLICY", _choice("arc", "lru")),
    "name": ("KVELASTIC_NAME", _name),
    "min_bytes": ("KVELASTIC_MIN", lambda n, t: parse_size(t, name=n)),
    "port": ("KVELASTIC_PORT", lambda n, t: _port(n, t)),
    "shared_budget_bytes": ("KVELASTIC_SHARED_BUDGET", _size),
    "shared_dir": (location.DIR_VARIABLE, location.parse_shared_dir),
    "shared_group": (location.GROUP_VARIABLE, location.parse_group),
}


#: Variables kvelastic no longer reads -> what it does now; start-up warns once for each one set.
RETIRED: dict[str, str] = {
    "KVELASTIC_COPY_PATH": "copies use the copy engines where a block's pieces are 32 KiB or wider, else GPU kernels",
    "KVELASTIC_CPU_STORE": "blocks are stored as computed with the cache in process, as they leave the GPU on ranks",
    "KVELASTIC_CPU_STORE_STREAM": "write-through's stores run on a stream of their own",
    "KVELASTIC_CPU_STORE_PATH": "write-through's stores go through a staging buffer of their own",
    "KVELASTIC_CPU_LOAD": "host hits load while their request waits wherever that can run, else before the step",
    "KVELASTIC_CPU_LOAD_ASYNC_MIN": "every host run that can load while its request waits does",
    "KVELASTIC_CPU_LOAD_PATH": "loads beside compute go through a staging buffer of their own, the cache in process",
    "KVELASTIC_CPU_LOAD_PIECES": "a host run two page groups long loads a group at a time, beside the next one's map",
    "KVELASTIC_CPU_PIN": "the host tier is pinned in the background while the engine serves",
    "KVELASTIC_CPU_AHEAD": "write-through keeps a quarter of the host tier for its copies",
    "KVELASTIC_CPU_STORE_STEP": "write-through issues at most 512 MiB of stores per scheduling step",
    "KVELASTIC_RESERVE_HOST_RUNS": "the warm reserve covers the longest host run reloaded in the last minute, to 2 GiB",
    "KVELASTIC_RESERVE_BUSY_STEP": "the warm reserve grows by at most 256 MiB per upkeep tick while requests run",
    "KVELASTIC_RELEASE": "memory running requests hold drains as they finish, or as vLLM preempts its newest",
    "KVELASTIC_TP_CONFIRM": "ranks confirm on their step replies (mp, Ray V2); other executors are refused at start-up",
    "KVELASTIC_TP_MAP_AFTER_LAUNCH": "a rank maps a step's page groups once the step's forward pass is launched",
    "KVELASTIC_PIPELINE": "pipeline parallelism runs wherever its executor is supported",
    "KVELASTIC_RAY": "Ray's V2 executor runs as the multiprocess one does; Ray's v1 executor is refused at start-up",
}
