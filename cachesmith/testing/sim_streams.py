"""Streams, events and asynchronous copies of the simulated CUDA device, ordered as CUDA orders them.

In: each device op (the stream it runs on, the storages it reads and writes), stream waits, event
records and waits, host syncs, and the non-blocking copies between pinned host memory and the
device. Out: findings where an op or a free is not ordered after the work it depends on, and each
asynchronous copy landing only when CUDA guarantees it has (until then its destination holds poison
and its source is unread).

Ordering is a vector clock per stream: each op advances its stream's tick; a stream has seen
another's work up to the tick it last waited for (`wait_event`, `wait_stream`); an op launched
after the host synchronized with a stream is ordered after that stream's work. A tensor's storage
remembers the (stream, tick) of its last write and of its reads on each stream: a read must have
seen the last write, a write must have seen the last write and every read (CUDA semantics,
"Stream semantics" in torch's CUDA notes).
"""
from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

Clock = dict[int, int]  # stream id -> the last tick of that stream's work that is known done

POISON_INT = -0x5A5A5A5A  # what an integer destination holds until its copy lands


def poison(t: torch.Tensor) -> None:
    """Fill `t` with what uninitialised or not-yet-written device memory may hold."""
    with torch._C.DisableTorchFunction(), torch.inference_mode():
        if t.is_floating_point() or t.is_complex():
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(POISON_INT if t.dtype.is_signed and t.element_size() >= 4 else 0x5A)


def _merge(into: Clock, other: Clock) -> None:
    for sid, tick in other.items():
        if into.get(sid, 0) < tick:
            into[sid] = tick


@dataclass(eq=False)
class PendingCopy:
    """A non-blocking copy issued on `stream_id` that has not landed: `dst` reads `src` when it does."""
    stream_id: int
    tick: int  # its place in its stream's work
    dst: torch.Tensor  # CPU data: a device tensor's `elem`, or a pinned host buffer
    src: torch.Tensor
    storage_keys: frozenset[int]  # device storages it touches
    is_to_host: bool

    def land(self) -> None:
        with torch._C.DisableTorchFunction(), torch.inference_mode():  # the simulation's own work
            self.dst.copy_(self.src)


class SimStream:
    """A stream: its ticks, and how far it has seen every other stream's work."""

    def __init__(self, order: "StreamOrder", name: str) -> None:
        self.order, self.name = order, name
        self.id = next(order.ids)
        self.tick = 0
        self.seen: Clock = {}

    def clock(self) -> Clock:
        return {**self.seen, self.id: self.tick}

    def wait_stream(self, other: "SimStream") -> None:
        self.order.wait(self, other.clock())

    def wait_event(self, event: "SimEvent") -> None:
        if event.recorded is not None:
            self.order.wait(self, event.recorded)

    def synchronize(self) -> None:
        self.order.host_waits(self.clock(), "stream.synchronize")

    def query(self) -> bool:
        self.order.host_waits(self.clock(), None)
        return True

    def __repr__(self) -> str:
        return f"SimStream({self.name})"


class SimEvent:
    """A point in a stream's work: what that stream had done, or seen done, when it was recorded."""

    def __init__(self, order: "StreamOrder") -> None:
        self.order = order
        self.recorded: Clock | None = None

    def record(self, stream: SimStream | None = None) -> None:
        self.recorded = (stream or self.order.current()).clock()

    def synchronize(self) -> None:
        if self.recorded is not None:
            self.order.host_waits(self.recorded, "event.synchronize")

    def query(self) -> bool:
        if self.recorded is not None:
            self.order.host_waits(self.recorded, None)
        return True


Span = tuple[int, int]  # the bytes [lo, hi) of a storage that a view reaches


def span_of(t: torch.Tensor) -> Span:
    """The bytes of its storage a tensor can reach (conservatively, from its first to its last element)."""
    size = t.element_size()
    lo = t.storage_offset() * size
    if t.numel() == 0:
        return lo, lo
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0)
    return lo, lo + (last + 1) * size


@dataclass
class _Access:
    span: Span
    stream_id: int
    tick: int
    is_write: bool


@dataclass
class _Use:
    """The recent reads and writes of one storage, and where it was allocated."""
    accesses: list[_Access] = field(default_factory=list)
    alloc: int | None = None  # the stream it was allocated on
    made_by: str = ""  # the op that allocated it, for messages
    lent: set[int] = field(default_factory=set)  # streams named by `record_stream`


def _overlap(a: Span, b: Span) -> bool:
    return a[0] < b[1] and b[0] < a[1]


class StreamOrder:
    """The simulation's streams and the order between them; `report(finding)` hears each finding."""

    def __init__(self, report: Callable[[str], None], sync: Callable[[str], None]) -> None:
        self.report, self._sync = report, sync
        self.ids = itertools.count(1)
        self.streams: list[SimStream] = []
        self.default = self.new_stream("default")
        self.host_seen: Clock = {}  # work the host has waited for (ops launched later come after it)
        self.pending: list[PendingCopy] = []
        self._uses: dict[int, _Use] = {}
        self._local = threading.local()
        self.lock = threading.RLock()

    def new_stream(self, name: str | None = None) -> SimStream:
        stream = SimStream(self, name or f"#{len(self.streams) + 1}")
        self.streams.append(stream)
        return stream

    # -- the current stream ----------------------------------------------------------------------
    def current(self) -> SimStream:
        return getattr(self._local, "stream", None) or self.default

    @contextmanager
    def on(self, stream: SimStream) -> Iterator[None]:
        previous = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = previous

    # -- waits -----------------------------------------------------------------------------------
    def wait(self, stream: SimStream, clock: Clock) -> None:
        """`stream` waits for the work in `clock` (no host sync): copies to the device in it land."""
        with self.lock:
            _merge(stream.seen, clock)
            self._land(lambda c: not c.is_to_host and clock.get(c.stream_id, 0) >= c.tick)

    def host_waits(self, clock: Clock, what: str | None) -> None:
        """The host waits until the work in `clock` is done (a sync, counted when `what` names it)."""
        if what is not None:
            self._sync(what)
        with self.lock:
            _merge(self.host_seen, clock)
            self._land(lambda c: clock.get(c.stream_id, 0) >= c.tick)

    def device_synchronize(self) -> None:
        """The host waits for every stream's work."""
        with self.lock:
            self._land(lambda c: True)
            for stream in self.streams:
                _merge(self.host_seen, stream.clock())

    def host_waited_for(self, stream: SimStream) -> None:
        """A blocking copy on `stream` returned: the host has seen all of `stream`'s work so far."""
        self.host_waits(stream.clock(), None)

    def _land(self, which: Callable[[PendingCopy], bool]) -> None:
        kept = []
        for copy in self.pending:
            if which(copy):
                copy.land()
            else:
                kept.append(copy)
        self.pending = kept

    # -- device ops ------------------------------------------------------------------------------
    def land(self, keys: set[int]) -> None:
        """Before an op on the current stream touches these storages: the copies issued before it on
        that stream and touching them have run (stream order)."""
        if self.pending:
            sid = self.current().id
            with self.lock:
                self._land(lambda c: c.stream_id == sid and bool(c.storage_keys & keys))

    def op(self, what: str, reads: dict[int, list[Span]], writes: dict[int, list[Span]], fresh: set[int]) -> None:
        """An op on the current stream reading and writing these spans of storages (`fresh`: the
        storages it allocated)."""
        stream = self.current()
        with self.lock:
            stream.tick += 1
            _merge(stream.seen, self.host_seen)
            for key in fresh:
                self._uses[key] = _Use(alloc=stream.id, made_by=what)
            for is_write, spans_of in ((False, reads), (True, writes)):
                for key, spans in spans_of.items():
                    use = self._uses.setdefault(key, _Use())
                    for span in spans:
                        self._check(stream, what, use, span, is_write)
                        self._note(use, _Access(span, stream.id, stream.tick, is_write))

    def _check(self, stream: SimStream, what: str, use: _Use, span: Span, is_write: bool) -> None:
        for old in use.accesses:
            if (old.is_write or is_write) and _overlap(old.span, span) \
                    and not self._has_seen(stream, old.stream_id, old.tick):
                verb = "writes" if is_write else "reads"
                past = "written" if old.is_write else "read"
                self.report(f"{what} on stream {stream.name}: {verb} memory last {past} on stream "
                            f"{self._name(old.stream_id)} with no wait_event/wait_stream between")
                return

    def _note(self, use: _Use, new: _Access) -> None:
        """Keep what a later op could still race with: drop what the host has waited for, and what
        this access covers on a stream that has seen it (a newer access there stands for it)."""
        kept = [old for old in use.accesses
                if self.host_seen.get(old.stream_id, 0) < old.tick
                and not (old.stream_id == new.stream_id and old.span[0] >= new.span[0]
                         and old.span[1] <= new.span[1] and (new.is_write or not old.is_write))]
        kept.append(new)
        use.accesses = kept[-64:]  # a bound: the oldest have long been waited for in practice

    @staticmethod
    def _has_seen(stream: SimStream, sid: int, tick: int) -> bool:
        return sid == stream.id or stream.seen.get(sid, 0) >= tick

    def _name(self, sid: int) -> str:
        return next((s.name for s in self.streams if s.id == sid), f"#{sid}")

    def freed(self, key: int) -> None:
        """Device memory freed: the caching allocator hands it to the next allocation on the stream
        it was allocated on, so every other stream that used it must have been waited for there
        or by the host, or named by `record_stream`."""
        with self.lock:
            use = self._uses.pop(key, None)
            if use is None or use.alloc is None:
                return
            home = next((s for s in self.streams if s.id == use.alloc), self.default)
            for old in use.accesses:
                if old.stream_id in use.lent or self._has_seen(home, old.stream_id, old.tick) \
                        or self.host_seen.get(old.stream_id, 0) >= old.tick:
                    continue
                self.report(f"a tensor (made by {use.made_by}) freed while stream {self._name(old.stream_id)} may "
                            f"still use it (allocated on stream {home.name}; no event of its work waited for, no "
                            "record_stream)")
                return

    def lend(self, key: int, stream: SimStream) -> None:
        """`record_stream`: the allocator reuses the memory only after `stream`'s work issued so far."""
        with self.lock:
            self._uses.setdefault(key, _Use()).lent.add(stream.id)

    # -- asynchronous copies ---------------------------------------------------------------------
    def issue_copy(self, dst: torch.Tensor, src: torch.Tensor, key: int, span: Span, is_to_host: bool) -> None:
        """A non-blocking copy between pinned host memory and the device storage `key`, on the
        current stream: the destination holds poison until it lands, and it reads its source then."""
        stream = self.current()
        spans = {key: [span]}
        self.op("non_blocking copy", spans if is_to_host else {}, {} if is_to_host else spans, set())
        with self.lock:
            poison(dst)
            self.pending.append(PendingCopy(stream.id, stream.tick, dst, src, frozenset({key}), is_to_host))

    def host_touches(self, t: torch.Tensor, what: str) -> None:
        """The host reads or writes pinned memory: a pending copy from or into it is a finding."""
        with self.lock:
            if not self.pending:
                return
            ptr = t.untyped_storage().data_ptr()
            for copy in self.pending:
                host = copy.dst if copy.is_to_host else copy.src
                if host.untyped_storage().data_ptr() == ptr:
                    self.report(f"{what}: pinned host memory used by the host while a non-blocking copy "
                                "from or into it may not have run (no event of it waited for)")
                    return
