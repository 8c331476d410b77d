"""Installs ``kvelastic-autopatch.pth`` beside the package, for wheels and editable installs.

The ``.pth`` line runs at interpreter start in every process that has
kvelastic installed; it checks ``KVELASTIC`` and, only when set, registers a
post-import hook on vLLM. setuptools has no declarative way to place a file at
the root of site-packages, hence these two small command overrides.
"""

import importlib.util
from pathlib import Path

from setuptools import __version__ as setuptools_version
from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "kvelastic-autopatch.pth"


def _pth_line() -> str:
    """The line ``kvelastic/switch.py`` writes, read by path: a build may not import the package."""
    spec = importlib.util.spec_from_file_location("_kvelastic_switch", Path(__file__).parent / "kvelastic" / "switch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.pth_line()


# One line, run by `site` at every interpreter start: imports nothing unless KVELASTIC is on.
PTH_LINE = _pth_line()


class BuildPyWithPth(build_py):
    """Regular wheels: copy the .pth to the root of the build tree (site-packages)."""

    def run(self) -> None:
        super().run()
        Path(self.build_lib, PTH).write_text(PTH_LINE)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return super().get_outputs(include_bytecode) + [str(Path(self.build_lib) / PTH)]


class _StrategyAddingPth:
    """Wraps setuptools' editable strategy so the editable wheel carries our .pth too."""

    def __init__(self, inner):  # noqa: ANN001 - setuptools' private strategy type
        self.inner = inner

    def __call__(self, wheel, files, mapping):  # noqa: ANN001
        self.inner(wheel, files, mapping)
        wheel.writestr(PTH, PTH_LINE)

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):  # noqa: ANN002
        return self.inner.__exit__(*exc)


class EditableWheelWithPth(editable_wheel):
    """Editable installs (PEP 660): same .pth, added through the wheel strategy."""

    def _select_strategy(self, name, tag, build_lib):  # noqa: ANN001
        return _StrategyAddingPth(super()._select_strategy(name, tag, build_lib))


def _license() -> dict[str, str]:
    """The license as an SPDX expression where setuptools knows them (77+), else as plain text.

    ``project.license`` is dynamic in pyproject.toml for this: the string form there needs
    setuptools 77, and the table form older ones read is deprecated from 77 on.
    """
    major = int(setuptools_version.split(".")[0])
    return {"license_expression": LICENSE} if major >= 77 else {"license": LICENSE}


LICENSE = "Apache-2.0"

setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth}, **_license())
