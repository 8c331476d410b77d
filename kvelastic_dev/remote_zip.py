"""Read a few members of a zip (a wheel) over HTTP range requests.

Some vLLM releases ship no sdist, only wheels of 400-500 MB, most of it
compiled kernels. The Python sources are about 5 MB of it. A zip keeps its
directory at the end, so reading the tail, then only the byte spans of the
wanted members, costs a handful of requests instead of the whole wheel.
"""

from __future__ import annotations

import io
import urllib.request
import zipfile
from typing import Callable, Iterable

from kvelastic.errors import KvelasticError

TAIL_BYTES = 1 << 20  # a wheel's central directory (about 2000 entries) fits well inside this
MERGE_GAP = 1 << 20  # spans closer than this are fetched in one request
READ_AHEAD = 256 << 10
TIMEOUT_S = 120


class SourceFetchError(KvelasticError):
    """A vLLM release's source could not be fetched for the static version matrix."""


class RangeUnsupported(SourceFetchError):
    """The server answered a range request with the whole file."""


def fetch_range(url: str, start: int, end: int) -> bytes:
    """Bytes ``start <= i < end`` of ``url``; RangeUnsupported if the server ignores ``Range``."""
    request = urllib.request.Request(url, headers={"Range": f"bytes={start}-{end - 1}"})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        if response.status != 206:
            raise RangeUnsupported(f"{url}: range request answered with HTTP {response.status}")
        data = response.read()
    if len(data) != end - start:
        raise SourceFetchError(f"{url}: asked for {end - start} bytes at {start}, got {len(data)}")
    return data


class RangeFile(io.RawIOBase):
    """A read-only, seekable file over ``fetch(start, end)``, serving reads from fetched spans."""

    def __init__(self, size: int, fetch: Callable[[int, int], bytes]) -> None:
        super().__init__()
        self._size = size
        self._fetch = fetch
        self._pos = 0
        self._spans: list[tuple[int, bytes]] = []
        self.requests = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def load(self, start: int, end: int) -> None:
        """Fetch ``[start, end)`` once and keep it for later reads."""
        end = min(end, self._size)
        if start < end:
            self._spans.append((start, self._fetch(start, end)))
            self.requests += 1

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        want = min(len(buffer), self._size - self._pos)
        if want <= 0:
            return 0
        data = self._cached(self._pos, want)
        if data is None:
            self.load(self._pos, self._pos + max(want, READ_AHEAD))
            data = self._cached(self._pos, want)
            assert data is not None
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def _cached(self, pos: int, length: int) -> bytes | None:
        for start, data in self._spans:
            if start <= pos and pos + length <= start + len(data):
                return data[pos - start: pos - start + length]
        return None


def member_spans(archive: zipfile.ZipFile, members: Iterable[zipfile.ZipInfo]) -> list[tuple[int, int]]:
    """Byte spans covering ``members``' local records, merged when close together.

    A local record ends where the next entry (or the central directory) starts;
    that bound holds whatever the local header's extra field holds.
    """
    offsets = sorted({info.header_offset for info in archive.infolist()} | {archive.start_dir})
    following = dict(zip(offsets, offsets[1:]))
    spans: list[list[int]] = []
    for info in sorted(members, key=lambda i: i.header_offset):
        start, end = info.header_offset, following[info.header_offset]
        if spans and start - spans[-1][1] <= MERGE_GAP:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])
    return [(start, end) for start, end in spans]


def read_members(fetch: Callable[[int, int], bytes], size: int, wanted: Callable[[str], bool]) -> dict[str, bytes]:
    """``{name: content}`` of the zip members whose names ``wanted`` accepts.

    ``fetch(start, end)`` returns bytes ``[start, end)`` of the zip, whose length is ``size``:
    the tail first (the central directory), then one call per merged span of wanted members.
    """
    remote = RangeFile(size, fetch)
    remote.load(max(0, size - TAIL_BYTES), size)
    with zipfile.ZipFile(remote) as archive:  # type: ignore[arg-type]
        members = [info for info in archive.infolist() if not info.is_dir() and wanted(info.filename)]
        for start, end in member_spans(archive, members):
            remote.load(start, end)
        return {info.filename: archive.read(info) for info in members}
