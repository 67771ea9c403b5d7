"""The client's view of a job's routing table: key group → subtask → TaskManager address."""

from __future__ import annotations

from dataclasses import dataclass

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common.errors import NotFoundError, Reason
from keyedstate.common.rpc.enums import name_of


@dataclass(frozen=True)
class OperatorRoutes:
    operator_id: str
    parallelism: int
    # subtask_of[g] is the subtask owning key group g (a list index beats arithmetic in hot loops)
    subtask_of: tuple[int, ...]
    addresses: tuple[str, ...]  # by subtask index


@dataclass(frozen=True)
class Limits:
    """The size limits (``state.limits.*``) of the TaskManagers serving a job; 0 where none is known."""

    max_key_bytes: int = 0
    max_value_bytes: int = 0
    max_list_elements: int = 0

    @classmethod
    def from_proto(cls, limits: pb.StateLimits) -> Limits:
        return cls(limits.max_key_bytes, limits.max_value_bytes, limits.max_list_elements)


@dataclass(frozen=True)
class Routing:
    job_id: str
    version: int
    max_parallelism: int
    job_status: str
    operators: dict[str, OperatorRoutes]
    limits: Limits = Limits()
    """What the client checks a call against before sending any of it."""

    @classmethod
    def from_proto(cls, table: pb.RoutingTable) -> Routing:
        """The lookup tables of a JobManager routing table: per operator, the subtask owning each key group."""
        by_op: dict[str, list[pb.Route]] = {}
        for route in table.routes:
            by_op.setdefault(route.operator_id, []).append(route)
        operators = {}
        m = table.max_parallelism
        for op_id, routes in by_op.items():
            routes.sort(key=lambda r: r.subtask_index)
            subtask_of = [0] * m
            for r in routes:
                for g in range(r.key_groups.start, r.key_groups.end + 1):
                    subtask_of[g] = r.subtask_index
            operators[op_id] = OperatorRoutes(op_id, len(routes), tuple(subtask_of), tuple(r.address for r in routes))
        return cls(
            table.job_id,
            table.version,
            m,
            name_of(pb.JobStatus, table.job_status),
            operators,
            Limits.from_proto(table.limits),
        )

    def operator(self, operator_id: str) -> OperatorRoutes:
        """The routes of ``operator_id``; NotFoundError (UNKNOWN_OPERATOR) listing the job's operators."""
        routes = self.operators.get(operator_id)
        if routes is None:
            known = ", ".join(sorted(self.operators)) or "none"
            raise NotFoundError(
                f"job {self.job_id!r} has no operator {operator_id!r} (operators: {known})",
                reason=Reason.UNKNOWN_OPERATOR,
            )
        return routes
