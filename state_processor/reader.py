"""Reading one state of a checkpoint or savepoint as an Arrow table or a pandas DataFrame.

    from keyedstate.state_processor import Savepoint, StateSerializers, read_arrow

    with Savepoint.open("s3://bucket/savepoints/savepoint-orders-7", {"s3.endpoint": ...}) as sp:
        table = read_arrow(sp, "counts", "total", StateSerializers(key="str", value="int"))

Values whose TTL expired are left out, as a running job would never return them
(``include_expired=True`` keeps them; the ``timestamp_ms`` column shows their age).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from keyedstate.common.clock import Clock, SystemClock
from keyedstate.common.ids import KeyGroupRange
from keyedstate.state_processor import records
from keyedstate.state_processor.records import StateSerializers
from keyedstate.state_processor.savepoint import Savepoint

if TYPE_CHECKING:
    import pandas as pd

logger = logging.getLogger(__name__)

_DEFAULT = StateSerializers()


def read_columns(
    savepoint: Savepoint,
    operator_id: str,
    state: str,
    serializers: StateSerializers = _DEFAULT,
    *,
    key_groups: KeyGroupRange | None = None,
    include_expired: bool = False,
    clock: Clock | None = None,
) -> dict[str, list[Any]]:
    """The state's rows as Python columns (see :mod:`.records` for the columns of each kind)."""
    descriptor = savepoint.state(operator_id, state)
    now = None if include_expired or descriptor.ttl is None else (clock or SystemClock()).now_ms()
    entries = savepoint.entries(operator_id, state, key_groups=key_groups)
    return records.columns(descriptor, entries, serializers, now)


def read_arrow(
    savepoint: Savepoint,
    operator_id: str,
    state: str,
    serializers: StateSerializers = _DEFAULT,
    *,
    key_groups: KeyGroupRange | None = None,
    include_expired: bool = False,
    clock: Clock | None = None,
) -> pa.Table:
    """One state as an Arrow table, keys and values decoded through ``serializers``."""
    cols = read_columns(
        savepoint,
        operator_id,
        state,
        serializers,
        key_groups=key_groups,
        include_expired=include_expired,
        clock=clock,
    )
    return records.to_arrow(savepoint.state(operator_id, state), cols, serializers)


def read_pandas(
    savepoint: Savepoint,
    operator_id: str,
    state: str,
    serializers: StateSerializers = _DEFAULT,
    *,
    key_groups: KeyGroupRange | None = None,
    include_expired: bool = False,
    clock: Clock | None = None,
) -> pd.DataFrame:
    """One state as a pandas DataFrame; values stay the Python objects the serializer returns."""
    import pandas as pd

    cols = read_columns(
        savepoint,
        operator_id,
        state,
        serializers,
        key_groups=key_groups,
        include_expired=include_expired,
        clock=clock,
    )
    return pd.DataFrame(cols)
