"""The static checker and the source cache, on small trees and archives made here (no network).

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

from kvelastic.errors import SourceFetchError
from kvelastic.patching import remote_zip, static_check, vllm_source
from kvelastic.patching.spec import Signature, Target
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


@pytest.mark.parametrize("qualname", QUALNAMES)
def test_parameters_match_inspect_signature(tree: Path, qualname: str) -> None:
    owner = importlib.import_module(f"{PACKAGE}.mod")
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    raw = vars(owner)[name] if isinstance(owner, type) else getattr(owner, name)
    function = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    assert static_check.find(tree, _target(qualname)).params == tuple(inspect.signature(function).parameters)


def test_check_target_reports_like_the_gate(tree: Path) -> None:
    v1 = Version.parse("1.5")
    static = _target("Runner.static", ("groups", "dtype"), "staticmethod")
    assert static_check.check_target(tree, static, v1) is None
    problems = {
        "no signature": static_check.check_target(tree, _target("conditional", ("x", "y")), Version.parse("3.0")),
        "params": static_check.check_target(tree, _target("conditional", ("x",)), v1),
        "static": static_check.check_target(tree, _target("Runner.method", ("self",), "staticmethod"), v1),
        "inherited": static_check.check_target(tree, _target("Runner.inherited", ("self", "x")), v1),
        "module": static_check.check_target(tree, Target(f"{PACKAGE}.gone", "f", _target("f").signatures), v1),
        "class": static_check.check_target(tree, _target("Runner", ("self",)), v1),
    }
    assert "declares no signature for vLLM 3.0.0" in problems["no signature"]
    assert "expected parameters ('x',), found ('x', 'y')" in problems["params"]
    assert "expected a staticmethod" in problems["static"]
    assert "does not exist" in problems["inherited"]
    assert f"module {PACKAGE}.gone is not in the source" in problems["module"]
    assert "expected a function" in problems["class"]


def test_check_release_needs_a_vllm_tree(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        static_check.check_release(tmp_path, Version.parse("0.28.0"), ())


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
