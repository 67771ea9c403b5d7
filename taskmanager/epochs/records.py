"""The key and value layout of a slot's staging database.

A staged key is::

    epoch (8 bytes) | partition (4) | attempt (8) | state id (2) | layout prefix | suffix

all big-endian, where ``layout prefix`` is the stored-key prefix of (key group, key, namespace)
from :mod:`keyedstate.taskmanager.state.layout` (prefix-free per key and namespace) and the
state id is the index of the state in the slot's declared states. So one attempt's writes are
one contiguous range, an epoch's writes are one range, and every epoch up to N is ``[b"", N+1)``.

Per state kind (the first byte of a staged value is its tag):

* value: ``prefix`` -> ``PUT + value`` | ``CLEAR``
* reducing: ``prefix`` -> ``DELTA + vector`` (fold into the committed value) |
  ``REPLACE + vector`` (cleared, then reduced to ``vector``) | ``CLEAR``
* list: ``prefix + HEAD`` -> ``APPEND|REPLACE + count (8 bytes)``, and the staged elements, one
  record per write request: ``prefix + ENTRY + seq (8 bytes)`` -> the request's elements of the
  list packed (:func:`pack_elements`), where ``seq`` is the staged count before the request
  (so records sort in request order); ``REPLACE`` with count 0 clears. One record per request
  rather than per element: a bulk append stages, and a commit reads, one record per list.
* map: ``prefix + HEAD`` -> ``CLEAR`` when the committed map was cleared first; entries at
  ``prefix + ENTRY + user key`` -> ``PUT + value`` | ``REMOVED``

``HEAD`` sorts before ``ENTRY``, so a scan meets a list's header or a map's clear marker before
its entries, and map entries in user-key order (the order of a committed map scan).

Each staged write request also leaves a *request marker* under the reserved state id
``MARKER_STATE_ID`` (after every real state id, so an attempt's data is the range before its
markers): ``attempt | 0xFFFF | sequence (8 bytes)`` -> empty. A marker makes a retried request
with the same sequence number a no-op, and the markers are what a commit counts against the
winner's ledger.
"""

from __future__ import annotations

import logging
import marshal
from typing import cast

from keyedstate.common.errors import KeyedStateError, Reason

logger = logging.getLogger(__name__)

EPOCH_BYTES = 8
PARTITION_BYTES = 4
ATTEMPT_BYTES = 8
STATE_ID_BYTES = 2
SEQ_BYTES = 8
ATTEMPT_PREFIX_LEN = EPOCH_BYTES + PARTITION_BYTES + ATTEMPT_BYTES
MARKER_STATE_ID = (1 << (8 * STATE_ID_BYTES)) - 1
MAX_STATES = MARKER_STATE_ID  # the last id is reserved for request markers

HEAD = b"\x00"
ENTRY = b"\x01"

PUT = b"P"
CLEAR = b"C"
DELTA = b"D"
REPLACE = b"R"
APPEND = b"A"
REMOVED = b"X"

PUT_TAG = PUT[0]
CLEAR_TAG = CLEAR[0]
DELTA_TAG = DELTA[0]
REPLACE_TAG = REPLACE[0]
APPEND_TAG = APPEND[0]
REMOVED_TAG = REMOVED[0]


def epoch_prefix(epoch: int) -> bytes:
    return epoch.to_bytes(EPOCH_BYTES, "big")


def attempt_prefix(epoch: int, partition: int, attempt: int) -> bytes:
    return (
        epoch.to_bytes(EPOCH_BYTES, "big")
        + partition.to_bytes(PARTITION_BYTES, "big")
        + attempt.to_bytes(ATTEMPT_BYTES, "big")
    )


def state_prefix(attempt: bytes, state_id: int) -> bytes:
    """Where one attempt's staged entries of one state start."""
    return attempt + state_id.to_bytes(STATE_ID_BYTES, "big")


def request_marker(attempt: bytes, sequence: int) -> bytes:
    """The marker of write request ``sequence`` of the attempt whose prefix is ``attempt``."""
    return state_prefix(attempt, MARKER_STATE_ID) + sequence.to_bytes(SEQ_BYTES, "big")


def attempt_data_range(epoch: int, partition: int, attempt: int) -> tuple[bytes, bytes]:
    """``[begin, end)`` of one attempt's staged data, its request markers excluded."""
    prefix = attempt_prefix(epoch, partition, attempt)
    return prefix, state_prefix(prefix, MARKER_STATE_ID)


def attempt_markers_range(epoch: int, partition: int, attempt: int) -> tuple[bytes, bytes]:
    """``[begin, end)`` of one attempt's request markers."""
    return state_prefix(attempt_prefix(epoch, partition, attempt), MARKER_STATE_ID), attempt_prefix(
        epoch, partition, attempt + 1
    )


def through_epoch(epoch: int) -> tuple[bytes, bytes]:
    """``[begin, end)`` covering everything staged for epochs up to ``epoch``."""
    return b"", epoch_prefix(epoch + 1)


def one_epoch(epoch: int) -> tuple[bytes, bytes]:
    return epoch_prefix(epoch), epoch_prefix(epoch + 1)


def list_header(tag: bytes, count: int) -> bytes:
    return tag + count.to_bytes(SEQ_BYTES, "big")


def parse_list_header(raw: bytes) -> tuple[int, int]:
    """(tag, staged element count) of a list header."""
    if len(raw) != 1 + SEQ_BYTES or raw[0] not in (APPEND_TAG, REPLACE_TAG):
        raise corrupt(f"list header {raw[:16]!r}")
    return raw[0], int.from_bytes(raw[1:], "big")


def element_key(list_entry_prefix: bytes, seq: int) -> bytes:
    """``list_entry_prefix`` is ``staged prefix + ENTRY``."""
    return list_entry_prefix + seq.to_bytes(SEQ_BYTES, "big")


def pack_elements(elements: list[bytes]) -> bytes:
    """One staged record holding a request's elements of one list, in order.

    ``marshal`` packs and unpacks a list of bytes in C. Its format may change between Python
    versions, which is harmless here: staging is never persisted beyond the process (it is
    dropped when a slot opens, closes or the TaskManager restarts).
    """
    return marshal.dumps(elements)


def unpack_elements(raw: bytes) -> list[bytes]:
    """The elements of a staged list record (see :func:`pack_elements`)."""
    try:
        elements = marshal.loads(raw)
    except (EOFError, ValueError, TypeError) as exc:
        raise corrupt(f"list elements {raw[:16]!r}") from exc
    if elements.__class__ is not list:
        raise corrupt(f"list elements {raw[:16]!r}")
    return cast("list[bytes]", elements)


def corrupt(what: str) -> KeyedStateError:
    return KeyedStateError(
        f"the epoch staging database holds a malformed record ({what}); abort the epoch and re-run the micro-batch",
        reason=Reason.INTERNAL,
    )
