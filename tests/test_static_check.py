"""The source lookup and the source cache, on small trees and archives made here (no network).

The checker must list parameters exactly as ``inspect.signature`` does, so
each case is also imported and compared with it.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import io
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

from kvelastic.patching import gate, source
from kvelastic.patching.spec import Absent, Attributes, Signature, Target
from kvelastic_dev import remote_zip, vllm_source
from kvelastic_dev.remote_zip import SourceFetchError
from kvelastic.patching.versions import Version, VersionRange

PACKAGE = "kvstatic_fixture"
MOD = textwrap.dedent('''
    import functools
    from .impl import helper
    from kvstatic_fixture.impl import other as renamed

    def deco(fn):
        @functools.wraps(fn)
        def inner(*a, **k):
            return fn(*a, **k)
        return inner

    class Base:
        def inherited(self, x):
            pass

    class Runner(Base):
        def method(self, a, /, b, *args, c, d=1, **kw):
            pass

        @staticmethod
        def static(groups, dtype):
            pass

        @classmethod
        def klass(cls, n):
            pass

        @deco
        def decorated(self, config):
            pass

        async def coroutine(self, q):
            pass

        class Inner:
            def deep(self, z):
                pass

    if True:
        def conditional(x, y):
            pass
    else:
        def conditional(x):
            pass

    from typing import TYPE_CHECKING
    if TYPE_CHECKING:
        def typed(a, b):
            pass
    else:
        def typed(a):
            pass

    try:
        def guarded(a, b):
            pass
    except ImportError:
        def guarded(a):
            pass

    import dataclasses

    @dataclasses.dataclass
    class Record:
        field_a: int
        field_b: str = ""

        @property
        def prop(self):
            return 1

        @prop.setter
        def prop(self, value):
            pass

        @property
        def read_only(self):
            return 2

    class Holder:
        level = 1

        def __init__(me, x):
            me.a = x
            me.b: int = 2
            me.c, (me.d, e) = 1, (2, 3)
            if x:
                me.e = 5

        def method(self):
            self.not_in_init = 1
''')
IMPL = "def helper(p, *, q):\n    pass\n\ndef other(r):\n    pass\n"
QUALNAMES = ("Runner.method", "Runner.static", "Runner.klass", "Runner.decorated", "Runner.coroutine",
             "Runner.Inner.deep", "conditional", "typed", "guarded", "helper", "renamed")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    package = tmp_path / PACKAGE
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text(MOD)
    (package / "impl.py").write_text(IMPL)
    sys.path.insert(0, str(tmp_path))
    yield tmp_path
    sys.path.remove(str(tmp_path))
    for name in [n for n in sys.modules if n.startswith(PACKAGE)]:
        del sys.modules[name]


def _target(qualname: str, params: tuple[str, ...] = (), kind: str = "function") -> Target:
    return Target(f"{PACKAGE}.mod", qualname, (Signature(VersionRange.of("1.0", "2.0"), params),), kind)


def _class(qualname: str, names: tuple[str, ...]) -> Target:
    return Target(f"{PACKAGE}.mod", qualname, (Attributes(VersionRange.of("1.0", "2.0"), names),), "class", "read")


@pytest.mark.parametrize("qualname", QUALNAMES)
def test_parameters_match_inspect_signature(tree: Path, qualname: str) -> None:
    owner = importlib.import_module(f"{PACKAGE}.mod")
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    raw = vars(owner)[name] if isinstance(owner, type) else getattr(owner, name)
    function = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    assert source.find(tree, _target(qualname)).params == tuple(inspect.signature(function).parameters)
    assert source.find(tree, _target(qualname)) == gate.found(_target(qualname))


def test_check_target_reports_like_the_gate(tree: Path) -> None:
    v1 = Version.parse("1.5")
    static = _target("Runner.static", ("groups", "dtype"), "staticmethod")
    assert source.check_target(tree, static, v1) is None
    problems = {
        "undeclared": source.check_target(tree, _target("conditional", ("x", "y")), Version.parse("3.0")),
        "params": source.check_target(tree, _target("conditional", ("x",)), v1),
        "static": source.check_target(tree, _target("Runner.method", ("self",), "staticmethod"), v1),
        "inherited": source.check_target(tree, _target("Runner.inherited", ("self", "x")), v1),
        "module": source.check_target(tree, Target(f"{PACKAGE}.gone", "f", _target("f").shapes), v1),
        "class": source.check_target(tree, _target("Runner", ("self",)), v1),
    }
    assert "declares nothing for vLLM 3.0.0" in problems["undeclared"]
    assert "expected parameters ('x',), found ('x', 'y')" in problems["params"]
    assert "expected a staticmethod" in problems["static"]
    assert "does not exist" in problems["inherited"]
    assert f"module {PACKAGE}.gone is not in the source" in problems["module"]
    assert "expected a function" in problems["class"]


HOLDER_NAMES = ("level", "a", "b", "c", "d", "e", "method", "__init__")


def test_class_attributes_are_what_the_body_defines_and_init_sets_alike_in_source_and_live(tree: Path) -> None:
    live = gate.class_attributes(importlib.import_module(f"{PACKAGE}.mod").Holder)
    static = source.find(tree, _class("Holder", ())).attributes
    assert set(HOLDER_NAMES) <= static and set(HOLDER_NAMES) <= live
    assert "not_in_init" not in static and "not_in_init" not in live  # set later: cannot be checked up front
    fields = source.find(tree, _class("Record", ())).attributes
    assert {"field_a", "field_b", "prop", "read_only"} <= fields
    assert fields <= gate.class_attributes(importlib.import_module(f"{PACKAGE}.mod").Record)


V = VersionRange.of("1.0", "2.0")
#: Declarations and what both lookups must say of them (None: as declared).
VERDICTS = [
    (_class("Holder", HOLDER_NAMES), None),
    (_class("Record", ("field_a", "prop")), None),
    (_class("Holder", ("a", "not_in_init", "zz")), "('not_in_init', 'zz') are neither defined on the class"),
    (_class("conditional", ("a",)), "expected a class, found a function"),
    (_target("Record.prop", ("self", "value"), "setter"), None),
    (_target("Record.prop", ("self", "v"), "setter"), "expected parameters ('self', 'v'), found ('self', 'value')"),
    (_target("Record.read_only", ("self", "value"), "setter"), "found a read-only property"),
    (_target("Runner.method", ("self", "a", "b", "args", "c", "d", "kw"), "setter"), "found a function"),
    (_target("Record.prop", ("self",)), "expected a function, found a property"),
    (Target(f"{PACKAGE}.mod", "Runner.gone", (Absent(V),)), None),
    (Target(f"{PACKAGE}.mod", "Runner.method", (Absent(V),), "method"), "declared absent in vLLM 1.5.0"),
    (Target(f"{PACKAGE}.mod", "Record.read_only", (Absent(V),), "setter"), None),  # the setter is what is absent
    (Target(f"{PACKAGE}.mod", "Record.prop", (Absent(V),), "setter"), "declared absent"),
]


@pytest.mark.parametrize("target, verdict", VERDICTS, ids=lambda v: v.path if isinstance(v, Target) else "")
def test_one_rule_set_gives_the_source_and_the_live_lookup_the_same_verdict(tree: Path, target, verdict) -> None:
    version = Version.parse("1.5")
    static, live = source.check_target(tree, target, version), gate.check_target(target, version)
    assert static == live
    if verdict is None:
        assert static is None
    else:
        assert static is not None and verdict in static and static.startswith(target.path)


def test_declarations_refuse_shapes_that_do_not_fit_their_kind() -> None:
    with pytest.raises(ValueError, match="declares Attributes or Absent"):
        Target("m", "C", (Signature(V, ("self",)),), "class")
    with pytest.raises(ValueError, match="declares Signature or Absent"):
        Target("m", "f", (Attributes(V, ("x",)),))
    with pytest.raises(ValueError, match="overlap"):
        Target("m", "f", (Signature(V, ()), Absent(VersionRange.of("1.5", "3.0"))))
    with pytest.raises(ValueError, match="kind must be"):
        Target("m", "f", (), kind="property")


def test_check_release_needs_a_vllm_tree(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        source.check_release(tmp_path, Version.parse("0.28.0"), ())


def test_only_vllm_python_sources_are_kept() -> None:
    assert vllm_source.source_path("vllm/v1/worker/utils.py") == "vllm/v1/worker/utils.py"
    for other in ("tests/vllm/x.py", "vllm/_C.abi3.so", "vllm/../evil.py", "/vllm/x.py", "setup.py"):
        assert vllm_source.source_path(other) is None


def _sdist(tmp_path: Path) -> dict:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name in ("vllm/a.py", "vllm/sub/b.py", "tests/vllm/t.py", "vllm/k.so", "setup.py"):
            data = f"# {name}\n".encode()
            info = tarfile.TarInfo(f"vllm-9.9.9/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    path = tmp_path / "vllm-9.9.9.tar.gz"
    path.write_bytes(buffer.getvalue())
    return {"url": path.as_uri(), "filename": path.name,
            "digests": {"sha256": hashlib.sha256(buffer.getvalue()).hexdigest()}}


def test_sdist_is_streamed_filtered_and_verified(tmp_path: Path) -> None:
    entry, dest = _sdist(tmp_path), tmp_path / "out"
    assert vllm_source._from_sdist(entry, dest) == 2
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*.py")) == ["vllm/a.py", "vllm/sub/b.py"]
    entry["digests"]["sha256"] = "0" * 64
    with pytest.raises(SourceFetchError, match="sha256"):
        vllm_source._from_sdist(entry, tmp_path / "again")


def test_wheel_members_are_read_by_few_range_requests() -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for i in range(300):
            archive.writestr(f"vllm/m{i}.py", f"x = {i}\n" * 50)
            archive.writestr(f"vllm/k{i}.so", bytes(range(256)) * 64)
    blob = buffer.getvalue()
    calls: list[tuple[int, int]] = []

    def fetch(start: int, end: int) -> bytes:
        calls.append((start, end))
        return blob[start:end]

    members = remote_zip.read_members(fetch, len(blob), lambda name: name.endswith(".py"))
    assert members == {f"vllm/m{i}.py": (f"x = {i}\n" * 50).encode() for i in range(300)}
    assert len(calls) <= 3


def test_a_release_is_downloaded_once_and_committed_whole(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(vllm_source.CACHE_ENV, str(tmp_path / "cache"))
    downloads: list[str] = []

    def download(version: str, dest: Path) -> dict:
        downloads.append(version)
        (dest / "vllm").mkdir()
        (dest / "vllm" / "__init__.py").write_text("")
        return {"origin": "test", "url": "-", "files": 1}

    monkeypatch.setattr(vllm_source, "_download", download)
    first = vllm_source.fetch_source("9.9.9")
    assert first == tmp_path / "cache" / "9.9.9" and (first / "vllm" / "__init__.py").is_file()
    assert vllm_source.fetch_all(["9.9.9"]) == {"9.9.9": first} and downloads == ["9.9.9"]

    def broken(version: str, dest: Path) -> dict:
        (dest / "vllm").mkdir()
        raise OSError("connection reset")

    monkeypatch.setattr(vllm_source, "_download", broken)
    assert isinstance(vllm_source.fetch_all(["8.8.8"])["8.8.8"], SourceFetchError)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["9.9.9"]
