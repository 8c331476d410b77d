"""Where the shared files live: ``KVELASTIC_SHARED_DIR`` and ``KVELASTIC_SHARED_GROUP``, and nothing else.

The shared-file code, the CLI and the engine's settings all need these two
values; they are parsed here, below the settings, so that a bad value of an
unrelated variable never stops ``kvelastic status`` and the shared code never
reads the engine's settings.
"""

from __future__ import annotations

import grp
import os
from pathlib import Path
from typing import Mapping

from kvelastic.errors import ConfigError

DIR_VARIABLE = "KVELASTIC_SHARED_DIR"
GROUP_VARIABLE = "KVELASTIC_SHARED_GROUP"
DEFAULT_DIR = "/dev/shm"


def parse_shared_dir(name: str, text: str) -> str:
    """An existing directory named by an absolute path: a relative one would resolve per working directory."""
    value = text.strip()
    if not os.path.isabs(value):
        raise ConfigError(f"{name}={text!r} must be an absolute path (for example /dev/shm): a relative "
                          f"one would mean another directory for every working directory")
    if not os.path.isdir(value):
        raise ConfigError(f"{name}={text!r} is not an existing directory; kvelastic creates only its own "
                          f"folder inside it (for example /dev/shm)")
    return os.path.normpath(value)


def parse_group(name: str, text: str) -> int:
    """A group this process belongs to, by name or number: its members share one account per GPU."""
    value = text.strip()
    try:
        gid = int(value) if value.isdigit() else grp.getgrnam(value).gr_gid
    except KeyError:
        raise ConfigError(f"{name}={text!r} is not a group on this machine") from None
    if gid not in os.getgroups() and gid != os.getegid():
        raise ConfigError(f"{name}={text!r}: this process (uid {os.geteuid()}) is not a member of group {gid}; "
                          f"only members may share its accounts")
    return gid


def shared_location(environ: Mapping[str, str] | None = None) -> tuple[Path, int | None]:
    """``(KVELASTIC_SHARED_DIR, KVELASTIC_SHARED_GROUP)``, validated; ``(/dev/shm, None)`` where unset."""
    env = os.environ if environ is None else environ
    directory, group = env.get(DIR_VARIABLE, ""), env.get(GROUP_VARIABLE, "")
    where = parse_shared_dir(DIR_VARIABLE, directory) if directory.strip() else DEFAULT_DIR
    return Path(where), parse_group(GROUP_VARIABLE, group) if group.strip() else None
