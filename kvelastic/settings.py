"""kvelastic's settings, read once from ``KVELASTIC_*`` environment variables.

Every variable is validated here, and a bad value stops start-up with a
message that names the variable and the accepted form, before vLLM is touched.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Callable, Mapping

from kvelastic import switch
from kvelastic.errors import ConfigError
from kvelastic.units import parse_size

MIB = 1024 * 1024


def _seconds(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not a number of seconds (for example 10 or 0.5)") from None
    if value < 0 or value != value:
        raise ConfigError(f"{name}={text!r} must be a non-negative number of seconds")
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
    if not text.strip().isdigit() or not 0 < int(text) < 65536:
        raise ConfigError(f"{name}={text!r} is not a TCP port: expected a number from 1 to 65535")
    return int(text)


def _choice(*options: str) -> Callable[[str, str], str]:
    def parse(name: str, text: str) -> str:
        value = text.strip().lower()
        if value not in options:
            raise ConfigError(f"{name}={text!r} is not one of: {', '.join(options)}")
        return value

    return parse


def _name(name: str, text: str) -> str:
    value = text.strip()
    if not value or not all(c.isalnum() or c in "-_." for c in value) or len(value) > 64:
        raise ConfigError(f"{name}={text!r} must be 1-64 characters of letters, digits, '-', '_' or '.'")
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
    cpu_bytes: int | None = None
    cpu_policy: str = "arc"
    copy_path: str = "direct"  # chosen from bench_copy.py on an H100: docs/gpu-results.md
    name: str | None = None
    min_bytes: int = 0
    port: int = 0
    shared_budget_bytes: int | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for field in fields(cls):
            variable, parse = _VARIABLES[field.name]
            text = env.get(variable)
            if text is not None and text.strip() != "":
                values[field.name] = parse(variable, text)
        return cls(**values)  # type: ignore[arg-type]

    @staticmethod
    def variables() -> dict[str, str]:
        """Variable name -> field name, for documentation and the CLI."""
        return {variable: field for field, (variable, _) in _VARIABLES.items()}


_VARIABLES: dict[str, tuple[str, Callable[[str, str], object]]] = {
    "enabled": (switch.VARIABLE, switch.parse),
    "strict": ("KVELASTIC_STRICT", switch.parse),
    "chunk_bytes": ("KVELASTIC_CHUNK_SIZE", _chunk),
    "virtual_bytes": ("KVELASTIC_VIRTUAL_BYTES", _size),
    "limit_bytes": ("KVELASTIC_LIMIT", _size),
    "reserve_bytes": ("KVELASTIC_RESERVE", lambda n, t: parse_size(t, name=n)),
    "prefetch_bytes": ("KVELASTIC_PREFETCH", lambda n, t: parse_size(t, name=n)),
    "cache_ttl_s": ("KVELASTIC_CACHE_TTL", _seconds),
    "cpu_bytes": ("KVELASTIC_CPU_BYTES", _size),
    "cpu_policy": ("KVELASTIC_CPU_POLICY", _choice("arc", "lru")),
    "copy_path": ("KVELASTIC_COPY_PATH", _choice("direct", "staged")),
    "name": ("KVELASTIC_NAME", _name),
    "min_bytes": ("KVELASTIC_MIN", lambda n, t: parse_size(t, name=n)),
    "port": ("KVELASTIC_PORT", lambda n, t: _port(n, t)),
    "shared_budget_bytes": ("KVELASTIC_SHARED_BUDGET", _size),
}
