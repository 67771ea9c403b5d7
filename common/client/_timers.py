"""Per-key timers (Flink's ``TimerService``, Spark's ``TimerValues``/``handleExpiredTimer``) over map state.

Timers of an operator live in one TIMERS state (declare it with :func:`timers_state`), whose
entries are stored exactly as map entries. Every key
group has one *anchor* key, a fixed byte string that hashes into that key group; the timers of
all keys of the group are entries of the anchor's map, one namespace per time domain, with the
user key ``timestamp (8 bytes, big-endian, offset by 2**63) | serialized key``. The stored key
of a timer is therefore::

    key_group | anchor | domain | timestamp | key

so inside a key group the timers of a domain are sorted by time, "due at or before T" is one
bounded scan per key group, and checkpoints, restores and rescales move timers with their key
groups exactly as they move any other state. Registering and deleting are map writes, so under
an :class:`EpochScope` they are staged and committed with the epoch; firing a timer deletes it in
the same epoch, so a timer fires exactly once across retried tasks and re-run batches.
"""

from __future__ import annotations

import enum
import functools
import logging
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common.client._client import StateClient
from keyedstate.common.client._epoch import EpochScope
from keyedstate.common.client._states import MapState
from keyedstate.common.descriptors import StateDescriptor, StateKind
from keyedstate.common.errors import InvalidArgumentError, StaleRoutingError, WrongStateKindError
from keyedstate.common.keygroups import UPPER_BOUND_MAX_PARALLELISM, key_group
from keyedstate.common.serializers import Serializer, get_serializer

logger = logging.getLogger(__name__)

K = TypeVar("K")

DEFAULT_TIMERS_STATE = "timers"
_TS_OFFSET = 1 << 63
_TS_BYTES = 8
_ANCHOR_TAG = b"\x00keyedstate-timers\x00"
SCAN_CONCURRENCY = 16
"""How many key groups :meth:`TimerService.due` scans at once."""


class TimeDomain(enum.Enum):
    """Which clock a timer waits for (Flink's ``TimeDomain``; Spark's ``TimeMode``)."""

    EVENT_TIME = 0
    """Fires once the watermark reaches the timestamp."""
    PROCESSING_TIME = 1
    """Fires once the processing time (in Spark: the batch timestamp) reaches the timestamp."""

    @property
    def namespace(self) -> bytes:
        return bytes((self.value,))


@dataclass(frozen=True)
class Timer(Generic[K]):
    """One timer: ``key`` wants a callback at ``timestamp_ms`` in ``domain``."""

    key: K
    timestamp_ms: int
    domain: TimeDomain


def timers_state(name: str = DEFAULT_TIMERS_STATE) -> StateDescriptor:
    """The state an operator declares to hold its timers (kind TIMERS)."""
    return StateDescriptor(name, StateKind.TIMERS)


class _TimerEntries(MapState[bytes, bytes, bytes]):
    """The map calls a TimerService makes on its TIMERS state (timers are stored as map entries)."""

    kind = StateKind.TIMERS


@functools.lru_cache(maxsize=8)
def anchor_keys(max_parallelism: int) -> tuple[bytes, ...]:
    """One fixed key per key group whose hash lands in that group (``anchor_keys(m)[g]``).

    Found by counting through ``_ANCHOR_TAG + n``: deterministic, so every client and every job
    version agrees, and never a key a user serializer produces by accident (it starts with 0x00).
    """
    if not 1 <= max_parallelism <= UPPER_BOUND_MAX_PARALLELISM:
        raise InvalidArgumentError(f"max parallelism {max_parallelism} is outside 1..{UPPER_BOUND_MAX_PARALLELISM}")
    anchors: list[bytes | None] = [None] * max_parallelism
    missing = max_parallelism
    n = 0
    while missing:
        candidate = _ANCHOR_TAG + n.to_bytes(4, "big")
        g = key_group(candidate, max_parallelism)
        if anchors[g] is None:
            anchors[g] = candidate
            missing -= 1
        n += 1
    return tuple(a for a in anchors if a is not None)


def _encode_ts(timestamp_ms: int) -> bytes:
    if not -_TS_OFFSET <= timestamp_ms < _TS_OFFSET:
        raise InvalidArgumentError(f"timer timestamp {timestamp_ms} does not fit a signed 64-bit millisecond count")
    return (timestamp_ms + _TS_OFFSET).to_bytes(_TS_BYTES, "big")


def _decode_ts(raw: bytes) -> int:
    return int.from_bytes(raw[:_TS_BYTES], "big") - _TS_OFFSET


class TimerService(Generic[K]):
    """Register, delete and fire per-key timers of one operator, optionally inside an epoch.

    ``register_*``/``delete_*`` are idempotent (a key has at most one timer per timestamp and
    domain, as in Flink). :meth:`due` lists timers at or before a time without changing them;
    :meth:`pop_due` lists them and deletes them in the same call, which is how a runtime fires
    timers: under an :class:`EpochScope` the deletion commits with the epoch, together with
    whatever the timer's handler wrote, so each timer fires exactly once.
    """

    def __init__(
        self,
        client: StateClient,
        job_id: str,
        operator_id: str,
        name: str = DEFAULT_TIMERS_STATE,
        key_serializer: str | Serializer[Any] = "str",
        epoch: pb.EpochContext | EpochScope | None = None,
    ) -> None:
        self.client = client
        self.job_id = job_id
        self.operator_id = operator_id
        self.name = name
        self.key_serializer: Serializer[Any] = get_serializer(key_serializer)
        try:
            self._maps = {
                d: _TimerEntries(
                    client,
                    job_id,
                    operator_id,
                    name,
                    key_serializer="bytes",
                    user_key_serializer="bytes",
                    value_serializer="bytes",
                    namespace=d.namespace,
                    epoch=epoch,
                )
                for d in TimeDomain
            }
        except WrongStateKindError as exc:
            raise WrongStateKindError(
                f"timers need state {name!r} of operator {operator_id!r} declared as timers_state({name!r}): {exc.message}"
            ) from exc

    def _anchors(self) -> tuple[bytes, ...]:
        return anchor_keys(self.client.routing(self.job_id).max_parallelism)

    def _entries(self, keys: Sequence[K], timestamps: Sequence[int]) -> tuple[list[bytes], list[bytes]]:
        if len(keys) != len(timestamps):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(timestamps)} timestamps: pass one timestamp per key")
        anchors = self._anchors()
        m = len(anchors)
        kb = self.key_serializer.dumps_many(list(keys))
        return [anchors[key_group(k, m)] for k in kb], [_encode_ts(t) + k for k, t in zip(kb, timestamps)]

    # -- registration -----------------------------------------------------------------------
    def register_many(self, domain: TimeDomain, keys: Sequence[K], timestamps: Sequence[int]) -> None:
        """Register a timer at ``timestamps[i]`` for ``keys[i]`` in ``domain`` (one call per batch)."""
        anchors, entries = self._entries(keys, timestamps)
        if anchors:
            self._maps[domain].put_many(anchors, entries, [b""] * len(entries))

    def delete_many(self, domain: TimeDomain, keys: Sequence[K], timestamps: Sequence[int]) -> None:
        """Delete the timers at ``timestamps[i]`` of ``keys[i]`` in ``domain`` (absent ones are no error)."""
        anchors, entries = self._entries(keys, timestamps)
        if anchors:
            self._maps[domain].remove_many(anchors, entries)

    def register_event_time_timer(self, key: K, timestamp_ms: int) -> None:
        """Call back ``key`` once the watermark reaches ``timestamp_ms``."""
        self.register_many(TimeDomain.EVENT_TIME, [key], [timestamp_ms])

    def register_processing_time_timer(self, key: K, timestamp_ms: int) -> None:
        """Call back ``key`` once the processing time reaches ``timestamp_ms``."""
        self.register_many(TimeDomain.PROCESSING_TIME, [key], [timestamp_ms])

    def delete_event_time_timer(self, key: K, timestamp_ms: int) -> None:
        """Delete the event-time timer of ``key`` at ``timestamp_ms``."""
        self.delete_many(TimeDomain.EVENT_TIME, [key], [timestamp_ms])

    def delete_processing_time_timer(self, key: K, timestamp_ms: int) -> None:
        """Delete the processing-time timer of ``key`` at ``timestamp_ms``."""
        self.delete_many(TimeDomain.PROCESSING_TIME, [key], [timestamp_ms])

    # -- firing -----------------------------------------------------------------------------
    def due(self, domain: TimeDomain, up_to_ms: int, key_groups: Iterable[int] | None = None) -> Iterator[Timer[K]]:
        """The timers of ``domain`` at or before ``up_to_ms``, key group by key group, each in time order.

        ``key_groups``: only these (a Spark task passes the key groups of its partition); all by
        default. Each key group costs one bounded scan that stops at the first later timer; up to
        :data:`SCAN_CONCURRENCY` key groups are scanned at once (their round trips overlap).
        """
        anchors = self._anchors()
        groups = list(range(len(anchors)) if key_groups is None else key_groups)
        for g in groups:
            if not 0 <= g < len(anchors):
                raise InvalidArgumentError(
                    f"key group {g} is outside 0..{len(anchors) - 1} (the job's max parallelism)"
                )
        limit = _encode_ts(up_to_ms)
        state = self._maps[domain]

        def scan_once(g: int) -> list[bytes]:
            out = []
            for entry in state.user_keys(anchors[g]):
                if entry[:_TS_BYTES] > limit:
                    break
                out.append(entry)
            return out

        def scan(g: int) -> list[bytes]:
            try:
                return scan_once(g)
            except StaleRoutingError:
                # The scan picked its subtask from a routing table a rescale has replaced (concurrent
                # scans all start from the cached one): refresh it once and ask the new owner.
                self.client.routing(self.job_id, refresh=True)
                return scan_once(g)

        loads = self.key_serializer.loads
        for start in range(0, len(groups), SCAN_CONCURRENCY):
            window = groups[start : start + SCAN_CONCURRENCY]
            if len(window) == 1:
                found = [scan(window[0])]
            else:
                with ThreadPoolExecutor(max_workers=len(window), thread_name_prefix="timers-scan") as pool:
                    found = list(pool.map(scan, window))
            for entries in found:
                for entry in entries:
                    yield Timer(loads(entry[_TS_BYTES:]), _decode_ts(entry), domain)

    def pop_due(self, domain: TimeDomain, up_to_ms: int, key_groups: Iterable[int] | None = None) -> list[Timer[K]]:
        """:meth:`due`, then delete those timers (in the scope's epoch): the timers that fire now."""
        fired = list(self.due(domain, up_to_ms, key_groups))
        if fired:
            self.delete_many(domain, [t.key for t in fired], [t.timestamp_ms for t in fired])
        return fired

    def timers_of(self, key: K, domain: TimeDomain) -> list[int]:
        """The timestamps ``key`` has timers at in ``domain``, ascending (scans the key's key group)."""
        anchors = self._anchors()
        kb = self.key_serializer.dumps(key)
        return [
            _decode_ts(e)
            for e in self._maps[domain].user_keys(anchors[key_group(kb, len(anchors))])
            if e[_TS_BYTES:] == kb
        ]
