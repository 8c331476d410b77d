"""Fetch one vLLM release's Python sources once, into a cache shared between runs.

The version matrix checks every supported release's source without installing
any of them. Only ``vllm/**/*.py`` is kept (about 20 MB a release). The sdist
is streamed and filtered on the fly; a release without an sdist is read from
its wheel by HTTP range requests (about 5 MB of a 500 MB file), and only if
the server refuses ranges is the whole wheel fetched with ``pip download``.

Run ``python -m kvelastic_dev.vllm_source [VERSION ...]`` to fill the cache
(all supported releases by default) and print how long it took.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.parse
import urllib.request
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import IO, Any, Iterable, Sequence

from kvelastic_dev import remote_zip
from kvelastic_dev.remote_zip import SourceFetchError

PYPI_JSON = "https://pypi.org/pypi/vllm/json"  # the per-release URL is missing on some mirrors
CACHE_ENV = "KVELASTIC_VLLM_SRC_CACHE"
MARKER = ".kvelastic-source.json"
TIMEOUT_S = 120
ATTEMPTS = 3
WORKERS = 8


def cache_root() -> Path:
    """``$KVELASTIC_VLLM_SRC_CACHE``, else ``~/.cache/kvelastic/vllm-src``."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "kvelastic" / "vllm-src"


def source_path(member: str) -> str | None:
    """``member`` normalised if it is vLLM Python source (``vllm/**/*.py``), else None."""
    parts = PurePosixPath(member).parts
    if not parts or parts[0] != "vllm" or not member.endswith(".py") or ".." in parts:
        return None
    return "/".join(parts)


_INDEX_LOCK = threading.Lock()
_INDEX: dict[str, list[dict[str, Any]]] = {}


def release_files(version: str) -> list[dict[str, Any]]:
    """PyPI's file entries for ``vllm==version``, with absolute download URLs.

    The project's JSON (every release's files) is read once per process and
    shared by the fetching threads.
    """
    with _INDEX_LOCK:
        if not _INDEX:
            with urllib.request.urlopen(PYPI_JSON, timeout=TIMEOUT_S) as response:
                try:
                    _INDEX.update(json.load(response)["releases"])
                except (ValueError, KeyError, TypeError) as exc:
                    raise SourceFetchError(f"{PYPI_JSON} is not PyPI's project JSON ({exc!r})") from exc
    if version not in _INDEX:
        raise SourceFetchError(f"vllm {version} is not a release on PyPI")
    return [dict(entry, url=urllib.parse.urljoin(PYPI_JSON, entry["url"])) for entry in _INDEX[version]]


class _Hashing:
    """A read-through file that hashes what passes, so a streamed sdist is verified without a copy."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._stream = stream
        self.sha256 = hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        data = self._stream.read(size)
        self.sha256.update(data)
        return data


def _write(dest: Path, relative: str, data: bytes) -> None:
    path = dest / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _from_sdist(entry: dict[str, Any], dest: Path) -> int:
    """Stream the sdist, keep its ``vllm/**/*.py``; check its sha256. Returns the file count."""
    count = 0
    with urllib.request.urlopen(entry["url"], timeout=TIMEOUT_S) as response:
        stream = _Hashing(response)
        with tarfile.open(fileobj=stream, mode="r|gz") as archive:  # type: ignore[call-overload]
            for member in archive:
                relative = source_path(member.name.split("/", 1)[-1]) if member.isfile() else None
                extracted = archive.extractfile(member) if relative else None
                if relative and extracted:
                    _write(dest, relative, extracted.read())
                    count += 1
        stream.read()  # drain the gzip trailer and padding so the digest covers the whole file
    expected = entry.get("digests", {}).get("sha256")
    if expected and stream.sha256.hexdigest() != expected:
        raise SourceFetchError(f"{entry['filename']}: sha256 mismatch")
    return count


def _from_wheel(entry: dict[str, Any], dest: Path) -> int:
    url = entry["url"]
    members = remote_zip.read_members(lambda start, end: remote_zip.fetch_range(url, start, end),
                                      int(entry["size"]), lambda name: bool(source_path(name)))
    for name, data in members.items():
        _write(dest, source_path(name) or name, data)
    return len(members)


def _from_pip(version: str, dest: Path) -> int:
    """Last resort: the whole wheel through pip, unzipping only the sources."""
    with tempfile.TemporaryDirectory() as download:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        f"vllm=={version}", "-d", download], check=True, timeout=1800)
        count = 0
        for wheel in Path(download).glob("vllm-*.whl"):
            with zipfile.ZipFile(wheel) as archive:
                for name in archive.namelist():
                    if relative := source_path(name):
                        _write(dest, relative, archive.read(name))
                        count += 1
        return count


def _download(version: str, dest: Path) -> dict[str, Any]:
    """Fill ``dest`` with the release's sources; returns what to record in the marker."""
    files = release_files(version)
    sdists = [entry for entry in files if entry["packagetype"] == "sdist"]
    wheels = sorted((entry for entry in files if entry["packagetype"] == "bdist_wheel"),
                    key=lambda entry: ("x86_64" not in entry["filename"], entry["filename"]))
    if sdists:
        return {"origin": "sdist", "url": sdists[0]["url"], "files": _from_sdist(sdists[0], dest)}
    if not wheels:
        raise SourceFetchError(f"vllm {version} has neither an sdist nor a wheel on PyPI")
    try:
        return {"origin": "wheel-ranges", "url": wheels[0]["url"], "files": _from_wheel(wheels[0], dest)}
    except remote_zip.RangeUnsupported:
        shutil.rmtree(dest / "vllm", ignore_errors=True)
        return {"origin": "pip-download", "url": f"vllm=={version}", "files": _from_pip(version, dest)}


def fetch_source(version: str, cache: Path | None = None) -> Path:
    """Directory holding ``vllm/`` of ``version``'s sources, downloading it on first use.

    The download goes to a temporary directory renamed into place when
    complete, so an interrupted run or a concurrent one never leaves half a tree.
    """
    root = cache or cache_root()
    final = root / version
    if (final / MARKER).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    for _ in range(ATTEMPTS):
        work = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=root))
        try:
            record = dict(_download(version, work), version=version)
            if not record["files"]:
                raise SourceFetchError(f"vllm {version}: no vllm/*.py found in {record['url']}")
            (work / MARKER).write_text(json.dumps(record, indent=1))
            _commit(work, final)
            return final
        except (OSError, tarfile.TarError, zipfile.BadZipFile, subprocess.SubprocessError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            shutil.rmtree(work, ignore_errors=True)
    raise SourceFetchError(f"vllm {version}: fetching its source failed {ATTEMPTS} times: {errors}")


def _commit(work: Path, final: Path) -> None:
    if final.exists() and not (final / MARKER).is_file():
        shutil.rmtree(final, ignore_errors=True)  # left by a run killed mid-rename
    try:
        os.rename(work, final)
    except OSError:
        if not (final / MARKER).is_file():  # a concurrent run may have won; anything else is an error
            raise


def fetch_all(versions: Iterable[str], cache: Path | None = None,
              workers: int = WORKERS) -> dict[str, Path | SourceFetchError]:
    """Fetch ``versions`` in parallel threads; a failure is returned in place of its path."""
    def one(version: str) -> Path | SourceFetchError:
        try:
            return fetch_source(version, cache)
        except SourceFetchError as exc:
            return exc

    versions = list(versions)
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(versions)))) as pool:
        return dict(zip(versions, pool.map(one, versions)))


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv: Sequence[str] | None = None) -> int:
    from kvelastic_dev.releases import RELEASES

    versions = list(argv if argv else sys.argv[1:]) or list(RELEASES)
    started = time.monotonic()
    results = fetch_all(versions)
    elapsed = time.monotonic() - started
    failed = {v: r for v, r in results.items() if isinstance(r, SourceFetchError)}
    for version, error in failed.items():
        print(f"{version}: FAILED {error}", file=sys.stderr)
    root = cache_root()
    print(f"{len(versions) - len(failed)}/{len(versions)} releases in {root} after {elapsed:.1f} s; "
          f"cache holds {tree_bytes(root) / 1e6:.0f} MB")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
