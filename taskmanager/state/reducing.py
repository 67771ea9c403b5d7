"""Reducing state: fixed-layout vectors of int64/float64 fields combined per field by SUM/MIN/MAX."""

from __future__ import annotations

import logging
import operator
import struct
from collections.abc import Callable, Sequence

from keyedstate.common.descriptors import NumberType, ReduceFunction, StateDescriptor
from keyedstate.common.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

_INT64_MIN = -(1 << 63)
_UINT64 = 1 << 64


def _wrap_int64(x: int) -> int:
    # int64 sums wrap around like Java's long (what a Flink job would see), never fail the batch.
    return (x - _INT64_MIN) % _UINT64 + _INT64_MIN


class Reducer:
    """Combines a stored vector with an operand, field by field."""

    def __init__(self, descriptor: StateDescriptor) -> None:
        self.state = descriptor.name
        self.format = descriptor.vector_format
        self.size = self.format.size
        self._functions: list[Callable[[float, float], float]] = [
            operator.add if f.function is ReduceFunction.SUM else (min if f.function is ReduceFunction.MIN else max)
            for f in descriptor.reduce_fields
        ]
        self._int_fields = [i for i, f in enumerate(descriptor.reduce_fields) if f.type is NumberType.INT64]
        self._all_sum = all(f.function is ReduceFunction.SUM for f in descriptor.reduce_fields)
        self._describe = ", ".join(f"{f.name}:{f.type.value}" for f in descriptor.reduce_fields)

    def check_operands(self, operands: Sequence[bytes]) -> None:
        """Raise InvalidArgumentError unless every operand is exactly the state's vector size in bytes."""
        size = self.size
        for i, op in enumerate(operands):
            if len(op) != size:
                raise InvalidArgumentError(
                    f"reduce operand {i} of state {self.state!r} has {len(op)} bytes; the state's vector "
                    f"({self._describe}) is {size} bytes of big-endian int64/float64 fields"
                )

    def combine(self, current: bytes | None, operand: bytes) -> bytes:
        """The new vector; a missing (or expired) current value starts from the operand."""
        if current is None:
            return operand
        unpack = self.format.unpack
        a, b = unpack(current), unpack(operand)
        if self._all_sum:
            combined = list(map(operator.add, a, b))
        else:
            combined = [fn(x, y) for fn, x, y in zip(self._functions, a, b)]
        try:
            return self.format.pack(*combined)
        except struct.error:
            for i in self._int_fields:
                combined[i] = _wrap_int64(int(combined[i]))
            return self.format.pack(*combined)
