"""Protobuf <-> domain conversions of the TaskManager's RPC edge.

Everything below the servicers and the JobManager connection works with domain types
(``common.handles``, ``state.StateLimits``, ``common.batches.Winner``). The checkpoint handles and
winners both daemons exchange are converted in ``common.rpc.convert``; these functions convert
what only the TaskManager reports.
"""

from __future__ import annotations

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.taskmanager.slots import SlotTable
from keyedstate.taskmanager.state import StateLimits


def limits_to_proto(limits: StateLimits) -> pb.StateLimits:
    """What the TaskManager reports to the JobManager, which hands it to clients (they check calls first)."""
    return pb.StateLimits(
        max_key_bytes=limits.max_key_bytes,
        max_value_bytes=limits.max_value_bytes,
        max_list_elements=limits.max_list_elements,
    )


def slot_reports(slots: SlotTable) -> list[jm_pb.SlotReport]:
    """The hosted slots as registrations and heartbeats report them."""
    return [
        jm_pb.SlotReport(
            slot_index=s.index,
            job_id=s.subtask.job_id,
            operator_id=s.subtask.operator_id,
            subtask_index=s.subtask.subtask_index,
        )
        for s in slots.all()
    ]
