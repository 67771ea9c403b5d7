"""The transaction a staged write belongs to: one attempt of one Spark task in one micro-batch."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from keyedstate.common.errors import InvalidArgumentError
from keyedstate.taskmanager.epochs.records import attempt_prefix

logger = logging.getLogger(__name__)

_MAX_PARTITION = (1 << 31) - 1
_MAX_I64 = (1 << 63) - 1


@dataclass(frozen=True)
class TaskAttempt:
    """``(epoch, partition, attempt)``: the micro-batch id, the Spark partition and its attempt id."""

    epoch: int
    partition: int
    attempt: int
    prefix: bytes = field(init=False, repr=False, compare=False)
    """The staging-DB key prefix of everything this attempt staged (see :mod:`.records`)."""

    def __post_init__(self) -> None:
        for name, value, limit in (
            ("epoch", self.epoch, _MAX_I64),
            ("partition", self.partition, _MAX_PARTITION),
            ("attempt", self.attempt, _MAX_I64),
        ):
            if not isinstance(value, int) or not 0 <= value <= limit:
                raise InvalidArgumentError(
                    f"EpochContext.{name} must be between 0 and {limit}, got {value!r}; send the Spark micro-batch id, "
                    "partition id and task attempt id"
                )
        object.__setattr__(self, "prefix", attempt_prefix(self.epoch, self.partition, self.attempt))

    def __str__(self) -> str:
        return f"epoch {self.epoch} partition {self.partition} attempt {self.attempt}"
