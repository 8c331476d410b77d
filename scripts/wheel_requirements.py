"""Print a wheel's own requirements for this interpreter, less the ones named to be left out.

vLLM 0.34.0's wheel pins ``flashinfer-python==0.7.3``, which the package index this project
installs from does not serve, so ``pip install vllm==0.34.0`` cannot resolve. flashinfer is a
GPU kernel library that nothing on the CPU imports; ``scripts/install_band.sh`` installs what
this prints (one requirement a line, environment markers already evaluated), then the wheel
itself with ``--no-deps``.

    python scripts/wheel_requirements.py WHEEL [--skip NAME ...]

Run with the target venv's interpreter: markers (``python_version``, ``platform_machine``) are
judged for it. Extras the wheel offers are not installed. A name given to ``--skip`` that the
wheel does not require is an error, so a stale skip list is noticed when a release drops the pin.
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from email.parser import Parser

from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name


class WheelRequirementsError(Exception):
    """The wheel has no metadata, or a name to skip is not among its requirements."""


def wheel_metadata(wheel: str) -> str:
    """The text of the wheel's ``*.dist-info/METADATA``."""
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1]
        if len(names) != 1:
            raise WheelRequirementsError(f"{wheel}: expected one .dist-info/METADATA, found {names}")
        return archive.read(names[0]).decode("utf-8")


def install_requirements(metadata: str, skip: list[str]) -> list[str]:
    """The ``Requires-Dist`` entries that apply here without extras, less ``skip``."""
    wanted = {canonicalize_name(name) for name in skip}
    required, seen = [], set()
    for line in Parser().parsestr(metadata).get_all("Requires-Dist") or []:
        requirement = Requirement(line)
        name = canonicalize_name(requirement.name)
        seen.add(name)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        if name not in wanted:
            requirement.marker = None
            required.append(str(requirement))
    missing = sorted(wanted - seen)
    if missing:
        raise WheelRequirementsError(f"asked to skip {missing}, which the wheel does not require")
    return required


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel")
    parser.add_argument("--skip", action="append", default=[], metavar="NAME")
    args = parser.parse_args(argv)
    try:
        print("\n".join(install_requirements(wheel_metadata(args.wheel), args.skip)))
    except WheelRequirementsError as error:
        print(f"wheel_requirements: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
