"""The local handles a StatefulProcessor sees (PySpark's ValueState, ListState, MapState) against a real cluster.

Each "task" is a :class:`ProcessorHandle` bound to a direct-mode :class:`PartitionState` on an
in-process cluster (no Spark needed): reads see the stored state plus the task's own writes, and
the writes reach the state only when the task flushes them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
from pyspark.sql.types import LongType, StringType, StructField, StructType

from keyedstate.common.client import StateClient
from keyedstate.common.descriptors import OperatorSpec, StateKind
from keyedstate.common.errors import InvalidArgumentError
from keyedstate.common.spark import PartitionState, ProcessorHandle, ProcessorState
from tests.fixtures.cluster import InProcessCluster

COUNT = StructType([StructField("n", LongType())])
PAIR = StructType([StructField("a", LongType()), StructField("b", StringType())])
PAGE = StructType([StructField("page", StringType())])
STATES = (
    ProcessorState("total", StateKind.VALUE, COUNT),
    ProcessorState("pairs", StateKind.LIST, PAIR),
    ProcessorState("pages", StateKind.MAP, COUNT, PAGE),
)
SCHEMAS = {s.name: (s.schema, s.user_key_schema) for s in STATES}


@pytest.fixture
def new_task(inprocess_cluster: Callable[..., InProcessCluster]) -> Iterator[Callable[[list[str]], ProcessorHandle]]:
    cluster = inprocess_cluster(taskmanagers=2, slots=1, backend="rocksdb")
    client = StateClient(cluster.address)
    client.submit_job("handles", [OperatorSpec("op", 2, tuple(s.descriptor() for s in STATES))])

    def make(keys: list[str]) -> ProcessorHandle:
        return ProcessorHandle.bound(PartitionState(client, "handles", "op", None), keys, "str", STATES, SCHEMAS)

    yield make
    client.close()


def test_value_state_reads_its_own_writes_and_flushes_them(new_task: Callable[[list[str]], ProcessorHandle]) -> None:
    task = new_task(["a", "b"])
    total = task.getValueState("total", "n long")
    task.set_key("a")
    assert not total.exists() and total.get() is None
    total.update((np.int64(3),))  # numpy scalars are stored as plain Python values, as PySpark's client does
    assert total.exists() and total.get() == (3,) and type(total.get()[0]) is int
    task.set_key("b")
    total.update([5])
    total.clear()
    assert total.get() is None
    task.flush()

    later = new_task(["a", "b", "c"])
    total = later.getValueState("total", "n long")
    later.set_key("a")
    assert total.get() == (3,)
    total.clear()
    later.set_key("b")
    assert not total.exists()
    later.set_key("c")
    total.update((7,))
    later.flush()
    again = new_task(["a", "c"])
    total = again.getValueState("total", "n long")
    again.set_key("a")
    assert total.get() is None
    again.set_key("c")
    assert total.get() == (7,)


def test_list_state_appends_blind_and_replaces(new_task: Callable[[list[str]], ProcessorHandle]) -> None:
    task = new_task(["a", "b"])
    pairs = task.getListState("pairs", "a long, b string")
    task.set_key("a")
    pairs.appendValue((1, "x"))
    pairs.appendList([(2, "y"), (3, "z")])
    assert list(pairs.get()) == [(1, "x"), (2, "y"), (3, "z")]
    task.set_key("b")
    pairs.put([(9, "q")])
    task.flush()

    # Appends without a read, then a put, then appends after it: the stored list and the writes in order.
    task = new_task(["a", "b"])
    pairs = task.getListState("pairs", "a long, b string")
    task.set_key("a")
    pairs.appendValue((4, "w"))
    task.set_key("b")
    pairs.put([(10, "r")])
    pairs.appendValue((11, "s"))
    assert list(pairs.get()) == [(10, "r"), (11, "s")]
    task.flush()

    task = new_task(["a", "b"])
    pairs = task.getListState("pairs", "a long, b string")
    task.set_key("a")
    assert list(pairs.get()) == [(1, "x"), (2, "y"), (3, "z"), (4, "w")]
    pairs.clear()
    assert not pairs.exists() and list(pairs.get()) == []
    pairs.appendValue((5, "v"))
    task.set_key("b")
    assert pairs.exists() and list(pairs.get()) == [(10, "r"), (11, "s")]
    task.flush()

    task = new_task(["a"])
    pairs = task.getListState("pairs", "a long, b string")
    task.set_key("a")
    assert list(pairs.get()) == [(5, "v")]


def test_map_state_merges_its_writes_over_the_stored_map(new_task: Callable[[list[str]], ProcessorHandle]) -> None:
    task = new_task(["a", "b"])
    pages = task.getMapState("pages", "page string", "n long")
    task.set_key("a")
    assert not pages.exists()
    pages.updateValue(("home",), (1,))
    pages.updateValue(("cart",), (2,))
    pages.updateValue(("gone",), (3,))
    pages.removeKey(("gone",))
    assert pages.getValue(("home",)) == (1,) and pages.containsKey(("cart",)) and not pages.containsKey(("gone",))
    task.set_key("b")
    pages.updateValue(("x",), (1,))
    task.flush()

    task = new_task(["a", "b"])
    pages = task.getMapState("pages", "page string", "n long")
    task.set_key("a")
    assert dict(pages.iterator()) == {("home",): (1,), ("cart",): (2,)}
    pages.removeKey(("home",))
    pages.updateValue(("cart",), (5,))
    pages.updateValue(("pay",), (1,))
    assert sorted(pages.keys()) == [("cart",), ("pay",)] and sorted(pages.values()) == [(1,), (5,)]
    task.set_key("b")
    pages.clear()
    pages.updateValue(("y",), (2,))
    task.flush()

    task = new_task(["a", "b"])
    pages = task.getMapState("pages", "page string", "n long")
    task.set_key("a")
    assert dict(pages.iterator()) == {("cart",): (5,), ("pay",): (1,)}
    task.set_key("b")
    assert dict(pages.iterator()) == {("y",): (2,)}


def test_misuse_is_a_clear_error(new_task: Callable[[list[str]], ProcessorHandle]) -> None:
    task = new_task(["a"])
    total = task.getValueState("total", "n long")
    with pytest.raises(InvalidArgumentError, match="needs a grouping key"):
        total.get()
    task.set_key("a")
    with pytest.raises(InvalidArgumentError, match="has 2 fields, the schema n has 1"):
        total.update((1, 2))
    with pytest.raises(InvalidArgumentError, match="a value is a tuple"):
        total.update(1)
    with pytest.raises(InvalidArgumentError, match="takes a list of tuples"):
        task.getListState("pairs", "a long, b string").put(5)
    with pytest.raises(InvalidArgumentError, match="not among the states"):
        task.getValueState("pairs", "a long, b string")
    with pytest.raises(InvalidArgumentError, match="timeMode"):
        task.registerTimer(1)
    with pytest.raises(InvalidArgumentError, match="DropState"):
        task.deleteIfExists("total")
    task.flush()  # the refused writes left nothing behind
    later = new_task(["a"])
    later.set_key("a")
    assert later.getValueState("total", "n long").get() is None
