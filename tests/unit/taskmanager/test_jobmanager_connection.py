"""The TaskManager's lease as its JobManager connection keeps it: against a small JobManager servicer on port 0.

The JobManager is another process, so it is the one thing faked here: a real gRPC server whose
answers each test scripts, and whose handlers move the shared manual clock to model the time a
request spends in flight.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common._proto.v1 import jobmanager_pb2_grpc as jm_grpc
from keyedstate.common.ids import SubtaskId, TaskManagerId
from keyedstate.common.lease import Lease
from keyedstate.taskmanager.rpc.jobmanager_connection import JobManagerConnection
from tests.fakes.clock import ManualClock

LEASE = 2_000
IN_FLIGHT = 150  # ms a request spends between the TaskManager's send and the JobManager's receive


class ScriptedJobManager(jm_grpc.ResourceManagerServicer):
    def __init__(self, clock: ManualClock, lease: Lease) -> None:
        self.clock = clock
        self.lease = lease
        self.known: list[bool] = []  # answers to the next heartbeats (default: known)
        self.kept: list[jm_pb.SlotReport] = []
        self.fail_heartbeats = False
        self.registrations: list[tuple[jm_pb.RegisterTaskManagerRequest, bool]] = []  # and: was the lease valid then
        self.heartbeats: list[jm_pb.HeartbeatRequest] = []

    def RegisterTaskManager(
        self, request: jm_pb.RegisterTaskManagerRequest, context: grpc.ServicerContext
    ) -> jm_pb.RegisterTaskManagerResponse:
        self.registrations.append((request, self.lease.valid()))
        self.clock.advance(IN_FLIGHT)
        return jm_pb.RegisterTaskManagerResponse(
            heartbeat_interval_ms=400,
            heartbeat_timeout_ms=5_000,
            jobmanager_session=f"s{len(self.registrations)}",
            lease_duration_ms=LEASE,
            kept_slots=self.kept,
        )

    def Heartbeat(self, request: jm_pb.HeartbeatRequest, context: grpc.ServicerContext) -> jm_pb.HeartbeatResponse:
        self.heartbeats.append(request)
        self.clock.advance(IN_FLIGHT)
        if self.fail_heartbeats:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the JobManager is unreachable")
        return jm_pb.HeartbeatResponse(known=self.known.pop(0) if self.known else True)


class Harness:
    def __init__(
        self,
        clock: ManualClock,
        lease: Lease,
        jm: ScriptedJobManager,
        connection: JobManagerConnection,
        retained: list[tuple[set[SubtaskId], bool]],
    ) -> None:
        self.clock, self.lease, self.jm, self.connection, self.retained = clock, lease, jm, connection, retained


@pytest.fixture
def harness() -> Iterator[Harness]:
    clock = ManualClock(monotonic_ms=50_000)
    lease = Lease(clock.boottime_ms)
    # DeregisterTaskManager is left to the generated base (UNIMPLEMENTED); the stub declares it abstract.
    jm = ScriptedJobManager(clock, lease)  # type: ignore[abstract]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    jm_grpc.add_ResourceManagerServicer_to_server(jm, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    retained: list[tuple[set[SubtaskId], bool]] = []
    hosted = [
        jm_pb.SlotReport(slot_index=0, job_id="j", operator_id="op", subtask_index=0),
        jm_pb.SlotReport(slot_index=1, job_id="j", operator_id="op", subtask_index=1),
    ]
    connection = JobManagerConnection(
        f"127.0.0.1:{port}",
        TaskManagerId("tm-a"),
        "127.0.0.1:7001",
        "127.0.0.1",
        2,
        "rocksdb",
        0,
        slot_reports=lambda: list(hosted),
        retain_slots=lambda kept, versions: retained.append((set(kept), lease.valid())),
        lease=lease,
        clock=clock,
        stop=threading.Event(),
    )
    yield Harness(clock, lease, jm, connection, retained)
    connection.close()
    server.stop(0).wait(5)


def test_registration_releases_the_slots_it_may_not_keep_before_the_lease_starts(harness: Harness) -> None:
    h = harness
    h.jm.kept = [jm_pb.SlotReport(slot_index=1, job_id="j", operator_id="op", subtask_index=1)]
    h.lease.renew(h.clock.boottime_ms(), 60_000)  # a lease from before (a previous JobManager's)
    sent = h.clock.boottime_ms()
    h.connection.register(5_000)

    [(request, valid_while_registering)] = h.jm.registrations
    assert valid_while_registering is False  # fenced before asking
    assert [(s.slot_index, s.subtask_index) for s in request.slots] == [(0, 0), (1, 1)]
    assert h.retained == [({SubtaskId("j", "op", 1)}, False)]  # slot 0 released while nothing is served
    assert h.connection.lease_duration_ms == LEASE and h.connection.heartbeat_interval_ms == 400
    # Counted from the registration's send time, not from when its answer arrived.
    assert h.lease.remaining_ms() == sent + LEASE - h.clock.boottime_ms() == LEASE - IN_FLIGHT


def test_a_known_heartbeat_renews_from_its_send_time_and_carries_the_session(harness: Harness) -> None:
    h = harness
    h.connection.register(5_000)
    h.clock.advance(1_000)
    sent = h.clock.boottime_ms()
    h.connection.heartbeat_once()
    assert h.jm.heartbeats[-1].jobmanager_session == "s1"
    assert h.lease.remaining_ms() == sent + LEASE - h.clock.boottime_ms() == LEASE - IN_FLIGHT
    h.clock.advance(LEASE - IN_FLIGHT - 1)
    h.lease.check("ValuePut")
    h.clock.advance(1)
    assert not h.lease.valid()


def test_an_unknown_heartbeat_revokes_the_lease_and_registers_again_fenced(harness: Harness) -> None:
    h = harness
    h.jm.kept = [jm_pb.SlotReport(slot_index=0, job_id="j", operator_id="op", subtask_index=0)]
    h.connection.register(5_000)
    assert h.lease.valid()
    h.jm.known = [False]
    h.jm.kept = []
    h.clock.advance(300)
    h.connection.heartbeat_once()

    assert len(h.jm.registrations) == 2 and h.connection.registrations == 2
    assert h.jm.registrations[1][1] is False  # the lease was revoked before the registration went out
    assert h.retained[-1] == (set(), False)  # every slot released before serving again
    assert h.lease.remaining_ms() == LEASE - IN_FLIGHT  # from the new registration's send time
    h.connection.heartbeat_once()
    assert h.jm.heartbeats[-1].jobmanager_session == "s2"


def test_an_unanswered_heartbeat_leaves_the_lease_to_run_out(harness: Harness) -> None:
    h = harness
    h.connection.register(5_000)
    h.jm.fail_heartbeats = True
    for _ in range(3):
        h.clock.advance(400)
        with pytest.raises(grpc.RpcError):
            h.connection.heartbeat_once()
    # Each failed heartbeat took IN_FLIGHT ms, and none renewed anything.
    assert h.lease.remaining_ms() == LEASE - IN_FLIGHT - 3 * (400 + IN_FLIGHT)
    h.clock.advance(h.lease.remaining_ms())
    assert not h.lease.valid()
    h.jm.fail_heartbeats = False
    h.connection.heartbeat_once()  # the JobManager is back and still knows it
    assert h.lease.remaining_ms() == LEASE - IN_FLIGHT
