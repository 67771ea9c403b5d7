"""The changelog segment format: every mutation kind round-trips; corruption is detected and refused."""

from __future__ import annotations

import pytest

from keyedstate.common.errors import CorruptCheckpointError, Reason
from keyedstate.taskmanager.changelog import ChangeSet, encode_segment, read_segment
from keyedstate.taskmanager.changelog.segment import HEADER, MAGIC, encode_record
from keyedstate.taskmanager.state.mutation import Mutation
from keyedstate.taskmanager.state.mutation import MutationKind as K

ONE = ChangeSet(
    7,
    1_700_000_000_123,
    (
        Mutation(K.VALUE_PUT, "v", b"k1", b"", value=b"x" * 300),
        Mutation(K.CLEAR, "m", b"k2", b"ns"),
        Mutation(K.REDUCE, "r", b"\x00\xff", b"", value=b"\x01" * 24),
        Mutation(K.LIST_APPEND, "l", b"k3", b"n", values=(b"a", b"", b"c" * 70_000)),
        Mutation(K.LIST_REPLACE, "l", b"k4", b"", values=()),
        Mutation(K.MAP_PUT, "m", b"k5", b"", user_key=b"u", value=b"w"),
        Mutation(K.MAP_REMOVE, "m", b"k5", b"", user_key=b"gone"),
        Mutation(K.VALUE_PUT, "ünïcode", b"", b"", value=b""),
    ),
)
TWO = ChangeSet(8, 1_700_000_000_999, (Mutation(K.VALUE_PUT, "v", b"k9", b"", value=b"last"),))


def test_every_mutation_kind_round_trips_with_epoch_and_timestamp() -> None:
    assert {m.kind for m in ONE.mutations} == set(K)
    assert list(read_segment(encode_segment([ONE, TWO]), "seg")) == [ONE, TWO]
    assert list(read_segment(HEADER, "empty")) == []


@pytest.mark.parametrize("offset", [len(HEADER) + 2, len(HEADER) + 5, len(HEADER) + 8, len(HEADER) + 40, -1])
def test_a_flipped_bit_anywhere_is_refused(offset: int) -> None:
    data = bytearray(encode_segment([ONE, TWO]))
    data[offset] ^= 0x10
    with pytest.raises(CorruptCheckpointError) as info:
        list(read_segment(bytes(data), "chk-3/seg-0"))
    assert info.value.reason is Reason.CORRUPT_CHECKPOINT
    assert "changelog segment chk-3/seg-0 is corrupt" in info.value.message
    assert "Restore from an older checkpoint" in info.value.message


def test_a_truncated_segment_is_refused_unless_reading_back_a_local_torn_tail() -> None:
    whole = encode_segment([ONE, TWO])
    for cut in (1, 5, 9, len(encode_record(TWO)) - 1):
        data = whole[:-cut]
        with pytest.raises(CorruptCheckpointError, match="truncated|claims"):
            list(read_segment(data, "uploaded"))
        # A crash mid-append leaves a torn last record; its epoch was never applied, so it is dropped.
        assert list(read_segment(data, "local", torn_tail_ok=True)) == [ONE]


def test_a_checksum_mismatch_in_the_last_record_is_refused_even_as_a_torn_tail() -> None:
    data = bytearray(encode_segment([ONE, TWO]))
    data[-1] ^= 1
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        list(read_segment(bytes(data), "local", torn_tail_ok=True))


def test_wrong_magic_and_unknown_version_are_refused_by_name() -> None:
    with pytest.raises(CorruptCheckpointError, match="magic"):
        list(read_segment(b"PK\x03\x04" + encode_segment([ONE])[4:], "zip"))
    with pytest.raises(CorruptCheckpointError, match="format version 9, this runtime reads version 1"):
        list(read_segment(MAGIC + (9).to_bytes(2, "big"), "future"))
    with pytest.raises(CorruptCheckpointError, match="header is truncated"):
        list(read_segment(MAGIC + b"\x00", "short"))
