"""Deriving an operator's state descriptors from a StatefulProcessor's init (no cluster, no Spark session)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from keyedstate.common.descriptors import StateKind, TtlConfig
from keyedstate.common.errors import InvalidArgumentError
from keyedstate.common.spark import processor_operator, processor_states


class Processor:
    """A processor whose init is given (duck-typed as PySpark's StatefulProcessor)."""

    def __init__(self, init: Callable[[Any], None]) -> None:
        self._init = init
        self.closed = 0

    def init(self, handle: Any) -> None:
        self._init(handle)
        self.state = handle.getValueState("kept", "n long")

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
        return iter([])

    def close(self) -> None:
        self.closed += 1


def test_every_state_init_asks_for_becomes_a_descriptor_with_its_ttl() -> None:
    def init(h: Any) -> None:
        h.getListState("events", "ts long", 5_000)
        h.getMapState("attrs", "k string", "v string")

    processor = Processor(init)
    states = processor_states(processor)
    assert [(s.name, s.kind, s.ttl_ms) for s in states] == [
        ("events", StateKind.LIST, 5_000),
        ("attrs", StateKind.MAP, None),
        ("kept", StateKind.VALUE, None),
    ]
    assert states[1].user_key_schema == "k string" and states[1].schema == "v string"
    spec = processor_operator(processor, "op", 2)
    assert [d.ttl for d in spec.states] == [TtlConfig(5_000), None, None]
    # init ran on a copy: the processor the query ships holds no recording handles.
    assert not hasattr(processor, "state") and processor.closed == 0


@pytest.mark.parametrize(
    ("init", "message"),
    [
        (lambda h: h.getListState("kept", "n long"), "asked for state 'kept' twice, differently"),
        (lambda h: h.getValueState("t", "n long", 0), "ttlDurationMs must be a positive int"),
        (lambda h: h.getValueState("", "n long"), "non-empty string name"),
        (lambda h: h.deleteIfExists("old"), "DropState"),
        (lambda h: h.registerTimer(1), "cannot register timers"),
        (lambda h: h.getValueState("v", "n long").get(), "read and write state in handleInputRows only"),
    ],
)
def test_a_processor_init_that_cannot_run_here_is_refused_by_name(init: Callable[[Any], Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        processor_states(Processor(init))


def test_something_that_is_not_a_processor_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="expected a pyspark StatefulProcessor"):
        processor_states(object())
