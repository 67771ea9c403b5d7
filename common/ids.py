"""Typed identifiers shared by every component."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator, NewType

from keyedstate.common.errors import InvalidArgumentError

JobId = NewType("JobId", str)
OperatorId = NewType("OperatorId", str)
TaskManagerId = NewType("TaskManagerId", str)
CheckpointId = NewType("CheckpointId", int)

# Ids end up in directory names (local and in checkpoint storage), so they are restricted to a
# portable character set.
_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


def validate_id(kind: str, value: str) -> str:
    """Return ``value`` if it is a valid id, else raise naming the rule."""
    if not isinstance(value, str) or not _ID_PATTERN.match(value) or ".." in value:
        raise InvalidArgumentError(
            f"invalid {kind} {value!r}: use 1-128 characters from [A-Za-z0-9_.-], starting with a letter or digit"
        )
    return value


@dataclass(frozen=True, order=True)
class KeyGroupRange:
    """An inclusive range of key groups, as Flink's ``KeyGroupRange``. Empty when end < start."""

    start: int
    end: int

    @classmethod
    def empty(cls) -> KeyGroupRange:
        return cls(0, -1)

    def __len__(self) -> int:
        return max(0, self.end - self.start + 1)

    def __contains__(self, key_group: object) -> bool:
        return isinstance(key_group, int) and self.start <= key_group <= self.end

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end + 1))

    def intersection(self, other: KeyGroupRange) -> KeyGroupRange:
        start, end = max(self.start, other.start), min(self.end, other.end)
        return KeyGroupRange(start, end) if start <= end else KeyGroupRange.empty()

    def __str__(self) -> str:
        return f"[{self.start}, {self.end}]"


@dataclass(frozen=True, order=True)
class SubtaskId:
    """One parallel instance of one operator of one job: what a slot hosts."""

    job_id: str
    operator_id: str
    subtask_index: int

    def __str__(self) -> str:
        return f"{self.job_id}/{self.operator_id}/{self.subtask_index}"

    def instance_dir_name(self) -> str:
        """The local directory name, after Flink's ``job_<jobId>_op_<operator>_<subtask>__<n>_<total>__uuid``.

        Flink appends a random uuid per attempt; here the name is stable so that a restarted
        TaskManager finds its own local state again (local recovery).
        """
        return f"job_{self.job_id}_op_{self.operator_id}_{self.subtask_index}"
