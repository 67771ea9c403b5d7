"""Which restored files a slot's next incremental checkpoint references instead of uploading again."""

from __future__ import annotations

from keyedstate.common.descriptors import OperatorSpec
from keyedstate.common.handles import SlotRestore, StateFileHandle, SubtaskStateHandle
from keyedstate.common.ids import CheckpointId, KeyGroupRange, OperatorId, SubtaskId
from keyedstate.taskmanager.slots import Slot
from keyedstate.taskmanager.snapshot.manager import owned_shared_files

BASE = "s3://bucket/checkpoints/orders"


FIRST_HALF = KeyGroupRange(0, 63)


def _slot(key_groups: KeyGroupRange = FIRST_HALF, base: str = BASE) -> Slot:
    return Slot(0, SubtaskId("orders", "agg", 0), OperatorSpec("agg", 2), key_groups, 128, 1, base, True)


def _handle(start: int, end: int, *files: StateFileHandle) -> SubtaskStateHandle:
    return SubtaskStateHandle(OperatorId("agg"), 0, KeyGroupRange(start, end), "rocksdb", list(files))


SST = StateFileHandle(f"{BASE}/shared/chk-7/agg-0-1f2e-000012.sst", 4096, "ab" * 32, "000012.sst", True)
MANIFEST = StateFileHandle(f"{BASE}/chk-9/agg-0/MANIFEST-000005", 300, "cd" * 32, "MANIFEST-000005", False)


def _restore(*handles: SubtaskStateHandle, owned: bool = True) -> SlotRestore:
    return SlotRestore(CheckpointId(9), handles, f"{BASE}/chk-9", owned=owned)


def test_an_owned_restore_references_its_shared_files_relative_to_the_new_checkpoint() -> None:
    owned = owned_shared_files(_slot(), _restore(_handle(0, 63, SST, MANIFEST)))
    assert owned == {
        "000012.sst": StateFileHandle("../shared/chk-7/agg-0-1f2e-000012.sst", 4096, "ab" * 32, "000012.sst", True)
    }


def test_no_claim_references_nothing() -> None:
    assert owned_shared_files(_slot(), _restore(_handle(0, 63, SST), owned=False)) == {}


def test_several_snapshots_after_a_rescale_reference_nothing() -> None:
    # The slot's DB is one of them plus ingested files, whose names may repeat another snapshot's.
    restore = _restore(_handle(0, 31, SST), _handle(32, 63, SST))
    assert owned_shared_files(_slot(), restore) == {}


def test_files_outside_the_jobs_shared_directory_are_not_referenced() -> None:
    assert owned_shared_files(_slot(base="s3://bucket/checkpoints/other"), _restore(_handle(0, 63, SST))) == {}
    # A directory that merely starts like shared/ is another one.
    odd = StateFileHandle(f"{BASE}/shared-old/000012.sst", 4096, "ab" * 32, "000012.sst", True)
    assert owned_shared_files(_slot(), _restore(_handle(0, 63, odd))) == {}


def test_a_snapshot_outside_the_slots_key_groups_is_not_referenced() -> None:
    assert owned_shared_files(_slot(KeyGroupRange(64, 127)), _restore(_handle(0, 63, SST))) == {}
