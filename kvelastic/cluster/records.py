"""The binary layout of an account file: one header, then fixed-size member slots.

Fixed-size little-endian records (``struct``) keep every slot at a known offset,
so a writer rewrites only what changed and a reader of another version can tell
from the header alone whether it understands the file. A slot with ``pid == 0``
is free. Sizes are padded beyond what the fields need, leaving room to add
fields without moving slots. A field added in that room keeps the version: every
writer pads with zeros, so a record from an older writer reads the new field as 0
("none"), and an older reader never looks past the fields it knows. Only a change
to an existing field, or a new field whose 0 would mean something, bumps
``VERSION`` (foreign versions are refused with the version named, see
:meth:`Header.unpack`).

Header and records are 512 bytes and start at multiples of 512, so none
crosses a 4 KiB page: each is written with one ``pwrite`` that a SIGKILL
cannot tear on tmpfs (the kernel checks for a fatal signal between pages). The
file is untrusted input like any shared file: every field is range-checked when
read, and anything out of range makes the account :class:`AccountCorrupt`.
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass, field

from kvelastic.cluster.errors import AccountCorrupt, BadLimits
from kvelastic.units import MAX_BYTES, MAX_BYTES_TEXT

MAGIC = b"KVELACCT"
VERSION = 2  # 2: 512-byte header and records, the member's pid namespace
DEFAULT_SLOTS = 64
MAX_SLOTS = 1024
MAX_PID = 1 << 31
HEADER_SIZE = 512
RECORD_SIZE = 512
NAME_BYTES = 64
MODEL_BYTES = 160
GPU_ID_BYTES = 112

# magic, version, slots, record size, budget, created, gpu id
_HEADER = struct.Struct(f"<8sIIIQd{GPU_ID_BYTES}s")
# name, model, pid, start time, port, min, max, mapped, cached, host, wanted,
# wanted_at, heartbeat, joined_at, start_max, pid namespace, waiting_since (added in the padding: 0 = none)
_RECORD = struct.Struct(f"<{NAME_BYTES}s{MODEL_BYTES}sqQI6Q3dQQd")
_PID = struct.Struct("<q")
_PID_OFFSET = NAME_BYTES + MODEL_BYTES
assert _HEADER.size <= HEADER_SIZE and _RECORD.size <= RECORD_SIZE


def _encode(text: str, size: int) -> bytes:
    """UTF-8 of ``text`` cut to ``size`` bytes without splitting a character."""
    data = text.encode("utf-8")
    if len(data) <= size:
        return data
    return data[:size].decode("utf-8", errors="ignore").encode("utf-8")


def _decode(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode("utf-8", errors="replace")


def _check(condition: bool, what: str) -> None:
    if not condition:
        raise AccountCorrupt(f"account field out of range: {what}")


def _storable(what: str, *values: int) -> None:
    """BadLimits unless every byte count is one the readers accept: nothing is written that would make
    the account unreadable for every engine (the readers refuse counts above ``MAX_BYTES``)."""
    for value in values:
        if not 0 <= value <= MAX_BYTES:
            raise BadLimits(f"{what} of {value} bytes cannot be stored: byte counts run from 0 to {MAX_BYTES_TEXT}")


@dataclass
class Header:
    """What the whole account shares: its budget and the GPU it is about."""

    budget_bytes: int
    gpu_id: str
    created: float
    slots: int = DEFAULT_SLOTS
    version: int = VERSION

    def pack(self) -> bytes:
        _storable("a budget", self.budget_bytes)
        data = _HEADER.pack(MAGIC, self.version, self.slots, RECORD_SIZE, self.budget_bytes,
                            self.created, _encode(self.gpu_id, GPU_ID_BYTES))
        return data.ljust(HEADER_SIZE, b"\0")

    @classmethod
    def unpack(cls, data: bytes) -> "Header":
        if len(data) < HEADER_SIZE:
            raise AccountCorrupt(f"account header is {len(data)} bytes, expected {HEADER_SIZE}")
        magic, version, slots, record_size, budget, created, gpu = _HEADER.unpack_from(data)
        if magic != MAGIC:
            raise AccountCorrupt("not a kvelastic account file (bad magic)")
        if version != VERSION or record_size != RECORD_SIZE:
            raise AccountCorrupt(f"account file version {version} (record {record_size} bytes) is not "
                                 f"version {VERSION} (record {RECORD_SIZE} bytes) that this kvelastic reads")
        _check(1 <= slots <= MAX_SLOTS, f"{slots} slots (1 to {MAX_SLOTS})")
        _check(0 < budget <= MAX_BYTES, f"budget {budget}")
        _check(math.isfinite(created), f"creation time {created}")
        return cls(budget_bytes=budget, gpu_id=_decode(gpu), created=created, slots=slots, version=version)

    @property
    def file_size(self) -> int:
        return HEADER_SIZE + self.slots * RECORD_SIZE


@dataclass
class MemberRecord:
    """One member's slot. Byte counts are physical KV bytes on this GPU."""

    name: str = ""
    model: str = ""
    pid: int = 0
    start_time: int = 0
    port: int = 0
    min_bytes: int = 0
    max_bytes: int = 0
    mapped_bytes: int = 0
    cached_bytes: int = 0
    host_bytes: int = 0
    wanted_bytes: int = 0
    wanted_at: float = 0.0
    heartbeat: float = 0.0
    joined_at: float = 0.0
    start_max_bytes: int = 0  # the cap the member joined with; what `kvelastic limit NAME none` restores
    pid_ns: int = 0  # inode of the member's pid namespace: its pid means nothing in another one
    waiting_since: float = 0.0  # when its current run of budget refusals began (0: none recorded)
    slot: int = field(default=-1, compare=False)

    @property
    def used(self) -> bool:
        return self.pid != 0

    @property
    def charged_bytes(self) -> int:
        """What this member counts against the budget: its holdings or its reservation."""
        return max(self.mapped_bytes, self.min_bytes)

    def pack(self) -> bytes:
        _storable(f"{self.name!r}'s record: a byte count", self.min_bytes, self.max_bytes, self.mapped_bytes,
                  self.cached_bytes, self.host_bytes, self.wanted_bytes, self.start_max_bytes)
        data = _RECORD.pack(
            _encode(self.name, NAME_BYTES), _encode(self.model, MODEL_BYTES), self.pid, self.start_time,
            self.port, self.min_bytes, self.max_bytes, self.mapped_bytes, self.cached_bytes,
            self.host_bytes, self.wanted_bytes, self.wanted_at, self.heartbeat, self.joined_at,
            self.start_max_bytes, self.pid_ns, self.waiting_since)
        return data.ljust(RECORD_SIZE, b"\0")

    @classmethod
    def unpack(cls, data: bytes, slot: int) -> "MemberRecord":
        if not _PID.unpack_from(data, _PID_OFFSET)[0]:
            return cls(slot=slot)  # a free slot: nothing to decode (most of the file, usually)
        (name, model, pid, start_time, port, min_b, max_b, mapped, cached, host, wanted,
         wanted_at, heartbeat, joined_at, start_max, pid_ns, waiting_since) = _RECORD.unpack_from(data)
        where = f"slot {slot}"
        _check(0 < pid < MAX_PID and port < 65536, f"{where}: pid {pid}, port {port}")
        for value in (min_b, max_b, mapped, cached, host, wanted, start_max):
            _check(value <= MAX_BYTES, f"{where}: byte count {value}")
        for value in (wanted_at, heartbeat, joined_at, waiting_since):
            _check(math.isfinite(value), f"{where}: time {value}")
        return cls(name=_decode(name), model=_decode(model), pid=pid, start_time=start_time, port=port,
                   min_bytes=min_b, max_bytes=max_b, mapped_bytes=mapped, cached_bytes=cached,
                   host_bytes=host, wanted_bytes=wanted, wanted_at=wanted_at, heartbeat=heartbeat,
                   joined_at=joined_at, start_max_bytes=start_max, pid_ns=pid_ns, waiting_since=waiting_since,
                   slot=slot)


def record_offset(slot: int) -> int:
    return HEADER_SIZE + slot * RECORD_SIZE


@functools.lru_cache(maxsize=8)
def _pids_of(slots: int) -> struct.Struct:
    """Every slot's pid in one call: most slots are free, and a transaction reads them all."""
    return struct.Struct("<" + f"{_PID_OFFSET}xq{RECORD_SIZE - _PID_OFFSET - _PID.size}x" * slots)


def unpack_records(data: bytes, slots: int) -> list[MemberRecord]:
    """``slots`` records laid end to end in ``data``, checked; a free slot (pid 0) costs no decoding."""
    pids = _pids_of(slots).unpack_from(data)
    return [MemberRecord.unpack(data[i * RECORD_SIZE:(i + 1) * RECORD_SIZE], i) if pid else MemberRecord(slot=i)
            for i, pid in enumerate(pids)]
