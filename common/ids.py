"""Typed identifiers shared by every component."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NewType

from keyedstate.common.errors import InvalidArgumentError

JobId = NewType("JobId", str)
OperatorId = NewType("OperatorId", str)
TaskManagerId = NewType("TaskManagerId", str)
CheckpointId = NewType("CheckpointId", int)

# Names end up in directory names (local and in checkpoint storage), RocksDB column families and
# metric labels, so every job, operator, state, TaskManager and cluster id passes one validator.
_NAME_CHARS = re.compile(r"^[A-Za-z0-9_.\-]+$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
MAX_NAME_LENGTH = 128


def validate_name(kind: str, value: object, *, max_length: int = MAX_NAME_LENGTH, letter_first: bool = False) -> str:
    """Return ``value`` if it is a safe name, else raise InvalidArgumentError naming the broken rule.

    Rules: 1 to ``max_length`` characters from ``[A-Za-z0-9_.-]``, starting with a letter or digit
    (a letter with ``letter_first``); no path separator, no ``..``, no control character.
    """
    first = "a letter" if letter_first else "a letter or digit"
    rule = f"use 1-{max_length} characters from [A-Za-z0-9_.-], starting with {first}"
    problem = _name_problem(value, max_length, letter_first)
    if problem is not None:
        shown = repr(value) if not isinstance(value, str) or len(value) <= 64 else repr(value[:64] + "...")
        raise InvalidArgumentError(f"invalid {kind} {shown}: {problem}; {rule}")
    return value  # type: ignore[return-value]


def _name_problem(value: object, max_length: int, letter_first: bool) -> str | None:
    if not isinstance(value, str):
        return f"expected a string, got {type(value).__name__}"
    if not value:
        return "it is empty"
    if len(value) > max_length:
        return f"it is {len(value)} characters long (at most {max_length})"
    if _CONTROL.search(value):
        return "it contains a control character"
    if "/" in value or "\\" in value:
        return "it contains a path separator"
    if ".." in value:
        return "it contains '..' (path traversal)"
    if not _NAME_CHARS.match(value):
        bad = sorted({c for c in value if not (c.isascii() and (c.isalnum() or c in "_.-"))})
        return f"it contains {', '.join(repr(c) for c in bad)}"
    if not (value[0].isalpha() if letter_first else value[0].isalnum()):
        return f"it must start with {'a letter' if letter_first else 'a letter or digit'}"
    return None


def validate_id(kind: str, value: str) -> str:
    """Return ``value`` if it is a valid id (job, operator, TaskManager, cluster), else raise naming the rule."""
    return validate_name(kind, value)


@dataclass(frozen=True, order=True)
class KeyGroupRange:
    """An inclusive range of key groups, as Flink's ``KeyGroupRange``. Empty when end < start."""

    start: int
    end: int

    @classmethod
    def empty(cls) -> KeyGroupRange:
        """The range holding no key group, ``[0, -1]``."""
        return cls(0, -1)

    def __len__(self) -> int:
        return max(0, self.end - self.start + 1)

    def __contains__(self, key_group: object) -> bool:
        return isinstance(key_group, int) and self.start <= key_group <= self.end

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end + 1))

    def intersection(self, other: KeyGroupRange) -> KeyGroupRange:
        """The key groups in both ranges; :meth:`empty` when they do not overlap."""
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
