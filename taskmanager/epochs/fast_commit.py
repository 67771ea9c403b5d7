"""The commit fast path for reducing state: staged records folded straight into one WriteBatch.

A staged reducing record already holds the main database's stored key (after the attempt
prefix and the state id, see :mod:`.records`) and was validated when it was staged, so when
every record of an epoch's winners is a reducing one, the commit needs no Mutation objects, no
re-validation and no key re-encoding: one multi-get per state for the current values, then one
WriteBatch with the committed-epoch marker. The result is byte for byte what
``KeyedStateBackend.apply`` of the folded mutations writes (same order, same ``now``, same
headers); anything else (another state kind among the records, a record it does not expect,
the hashmap backend) returns None and the caller takes that general path.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from keyedstate.common.descriptors import StateKind
from keyedstate.taskmanager.epochs import records as r
from keyedstate.taskmanager.state import KeyedStateBackend
from keyedstate.taskmanager.state.rocksdb import RocksDBKeyedStateBackend

logger = logging.getLogger(__name__)

_SKIP = r.ATTEMPT_PREFIX_LEN + r.STATE_ID_BYTES

# (stored keys, tagged staged values) of one state, in application order
_StateRecords = tuple[list[bytes], list[bytes]]


def _group(
    staged: Sequence[Sequence[tuple[bytes, bytes]]], sizes: dict[int, int]
) -> tuple[dict[int, _StateRecords], int] | None:
    """The records per state id and the mutation count the general path would apply; None if not all reducing.

    ``sizes`` maps the id of every reducing state to the size of its staged DELTA/REPLACE values.
    """
    per_state: dict[int, _StateRecords] = {}
    applied = 0
    for attempt_records in staged:
        for staged_key, value in attempt_records:
            sid = int.from_bytes(staged_key[r.ATTEMPT_PREFIX_LEN : _SKIP], "big")
            size = sizes.get(sid)
            if size is None:  # another state kind, or an id out of range
                return None
            tag = value[0] if value else -1
            if tag == r.DELTA_TAG and len(value) == size:
                applied += 1
            elif tag == r.REPLACE_TAG and len(value) == size:
                applied += 2  # the general path folds it into a CLEAR and a REDUCE
            elif tag == r.CLEAR_TAG:
                applied += 1
            else:
                return None  # malformed: the general path raises the error it deserves
            entry = per_state.get(sid)
            if entry is None:
                entry = per_state[sid] = ([], [])
            entry[0].append(staged_key[_SKIP:])
            entry[1].append(value)
    return per_state, applied


def commit_reducing(
    backend: KeyedStateBackend,
    states: Sequence[tuple[str, StateKind]],
    staged: Sequence[Sequence[tuple[bytes, bytes]]],
    meta: dict[bytes, bytes],
) -> int | None:
    """Apply the winners' staged records (one list per winner, partitions ascending) with ``meta``, atomically.

    Returns how many mutations the general path would have counted, or None (nothing written)
    when the records are not all reducing records on a RocksDB backend.
    """
    if not isinstance(backend, RocksDBKeyedStateBackend):
        return None
    handles = {sid: backend.validation.lookup(name) for sid, (name, _) in enumerate(states)}
    sizes = {sid: st.reducer.size + 1 for sid, st in handles.items() if st.reducer is not None}
    grouped = _group(staged, sizes)
    if grouped is None:
        return None
    per_state, applied = grouped
    with backend.stored_write(meta) as write:
        now, batch = write.now_ms, write.batch
        for sid, (keys, values) in per_state.items():
            st = handles[sid]
            reducer = st.reducer
            assert reducer is not None  # only reducing state ids were grouped
            header, handle, decode, combine = st.codec.header(now), st.handle, st.codec.decode, reducer.combine
            # The payload each key holds so far in this batch (None: cleared); a later record continues from it.
            latest: dict[bytes, bytes | None] = {}
            for key, value, current in zip(keys, values, backend.stored_get(st, keys)):
                tag = value[0]
                if tag == r.CLEAR_TAG:
                    latest[key] = None
                    batch.delete(key, handle)
                    continue
                if tag == r.DELTA_TAG:
                    new = combine(latest[key] if key in latest else decode(current, now), value[1:])
                else:  # REPLACE: cleared, then reduced to the operand
                    new = value[1:]
                latest[key] = new
                batch.put(key, header + new, handle)
    logger.debug("fast commit of %d reducing mutations on %s", applied, backend.subtask)
    return applied
