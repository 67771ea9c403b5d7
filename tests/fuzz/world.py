"""The cluster the RPC fuzzer plays against: valid requests per method, and how to break one field.

A descriptor-generated request almost always stops at the first check (an unknown job). To reach
the code behind it, each method has a template that builds a *valid* request against a live
fuzz job (its names, routing version, subtask addresses, keys its subtasks own); the fuzzer then
breaks one field of it. A method without a template is still fuzzed with generated messages.

Safety: generated addresses stay on loopback (a closed port) and generated paths stay inside a
sandbox under the test's tmp_path, so no request makes a daemon reach the network or write
anywhere else; ``protect()`` keeps the reference job and the real TaskManagers out of reach of
the control calls, so the reference state can be compared after the run.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import grpc
from google.protobuf import descriptor as d
from google.protobuf.message import Message
from hypothesis import strategies as st

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common._proto.v1 import taskmanager_pb2 as tm_pb
from keyedstate.common._proto.v1 import taskmanager_pb2_grpc as tm_grpc
from keyedstate.common.client import Routing, StateClient
from keyedstate.common.descriptors import OperatorSpec, ReduceField, StateDescriptor, StateKind
from keyedstate.common.keygroups import key_group
from keyedstate.common.rpc.descriptors import operator_spec_to_proto
from keyedstate.common.rpc.packed import pack
from tests.fuzz import proto_strategies as ps

FD = d.FieldDescriptor

REF_JOB = "refjob"
REF_OPERATOR = "rop"
FUZZ_OPERATOR = "fop"
PARALLELISM = 2
STATES = {"value": "v", "list": "l", "map": "m", "reducing": "r"}

PATH_FIELDS = {
    "target_directory",
    "restore_path",
    "checkpoint_base",
    "target_path",
    "checkpoint_path",
    "shared_path",
    "path",
}


def is_address_field(name: str) -> bool:
    """``address``, ``internal_address``, ...: a daemon connects to (and resolves) what it holds."""
    return name == "address" or name.endswith("_address")


def is_host_field(name: str) -> bool:
    return name == "host" or name.endswith("_host")


SAFE_HOSTS = {"127.0.0.1", "", "::1", "x" * 300}
TM_LIFECYCLE_METHODS = {"RegisterTaskManager", "Heartbeat", "DeregisterTaskManager", "ReportTaskFailure"}
"""Calls whose TaskManager id the fuzzer must never hit on a real TaskManager (it would deregister one,
or fail the fuzz job over as if that TaskManager's subtask had failed)."""


def fuzz_operators(operator_id: str = FUZZ_OPERATOR, parallelism: int = PARALLELISM) -> list[OperatorSpec]:
    return [
        OperatorSpec(
            operator_id,
            parallelism,
            (
                StateDescriptor(STATES["value"], StateKind.VALUE),
                StateDescriptor(STATES["list"], StateKind.LIST),
                StateDescriptor(STATES["map"], StateKind.MAP),
                StateDescriptor(
                    STATES["reducing"], StateKind.REDUCING, reduce_fields=(ReduceField("n"), ReduceField("s"))
                ),
            ),
        )
    ]


REDUCE_FORMAT = fuzz_operators()[0].states[3].vector_format


def keys_of(routing: Routing, operator_id: str, subtask: int, n: int, prefix: str = "k") -> list[bytes]:
    routes = routing.operator(operator_id)
    out: list[bytes] = []
    i = 0
    while len(out) < n:
        key = f"{prefix}{i}".encode()
        if routes.subtask_of[key_group(key, routing.max_parallelism)] == subtask:
            out.append(key)
        i += 1
    return out


@dataclass
class World:
    client: StateClient
    jm_address: str
    tm_addresses: list[str]
    tm_ids: list[str]
    sandbox: Path
    job: str = "fuzzjob"
    generation: int = 0
    routing: Routing | None = None
    keys: dict[int, list[bytes]] = field(default_factory=dict)
    session: str = ""
    checkpoint_path: str = ""
    """A completed checkpoint of the first fuzz job (RestoreJob's valid request restores it)."""
    channels: dict[str, grpc.Channel] = field(default_factory=dict)
    closed_port: socket.socket | None = None

    # -- setup -----------------------------------------------------------------------------
    def start(self) -> None:
        # A bound socket that never listens: connections to it are refused at once, and no
        # other process can take the port while the fuzzer advertises it as a TaskManager.
        self.closed_port = socket.socket()
        self.closed_port.bind(("127.0.0.1", 0))
        self.refresh(force_new=True)
        info = self.client.trigger_checkpoint(self.job, timeout_s=30)
        assert info.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, info.failure_reason
        self.checkpoint_path = info.path

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()
        if self.closed_port is not None:
            self.closed_port.close()

    @property
    def dead_address(self) -> str:
        assert self.closed_port is not None
        return f"127.0.0.1:{self.closed_port.getsockname()[1]}"

    def channel(self, address: str) -> grpc.Channel:
        if address not in self.channels:
            self.channels[address] = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        return self.channels[address]

    def refresh(self, force_new: bool = False) -> None:
        """Re-read the fuzz job's routing; submit a fresh fuzz job when the fuzzer cancelled or broke it.

        Broken includes a slot the fuzzer released or redeployed behind the JobManager's back: a
        read of every subtask must succeed.
        """
        if not force_new:
            try:
                routing = self.client.routing(self.job, refresh=True)
                if routing.job_status == "RUNNING" and FUZZ_OPERATOR in routing.operators:
                    self._use(routing)
                    for s, keys in self.keys.items():
                        tm_grpc.KeyedStateStub(self.channel(self.address_of(s))).ValueGet(
                            tm_pb.KeyedRequest(target=self.target(s, "value"), keys=keys[:1]), timeout=10
                        )
                    return
            except Exception:
                pass
        if self.generation:
            try:  # the replaced job's slots go back to the pool, or the fuzz jobs fill the cluster
                self.client.cancel_job(self.job)
            except Exception:
                pass
        for _ in range(3):
            self.generation += 1
            self.job = f"fuzzjob{self.generation}"
            try:
                self._use(self.client.submit_job(self.job, fuzz_operators()))
                return
            except Exception:
                continue
        self.routing = None

    def live_routing(self) -> Routing:
        """The fuzz job's routing; there is one once the world is built."""
        assert self.routing is not None, "no fuzz job is deployed"
        return self.routing

    def _use(self, routing: Routing) -> None:
        self.routing = routing
        parallelism = routing.operator(FUZZ_OPERATOR).parallelism
        self.keys = {
            s: keys_of(routing, FUZZ_OPERATOR, s, 3, prefix=f"g{self.generation}-") for s in range(parallelism)
        }

    # -- safety ----------------------------------------------------------------------------
    def sandbox_path(self, suffix: str) -> str:
        return (self.sandbox / "paths").as_uri() + "/" + suffix

    def override(self, field_d: d.FieldDescriptor) -> st.SearchStrategy[Any] | None:
        if field_d.type != FD.TYPE_STRING:
            return None
        if field_d.name in PATH_FIELDS:
            return st.one_of(ps.NAMEISH, st.sampled_from(ps.HOSTILE_TEXT[:24])).map(self.sandbox_path)
        if is_address_field(field_d.name):
            return st.sampled_from(sorted(self.safe_addresses()))
        if is_host_field(field_d.name):
            return st.sampled_from(sorted(SAFE_HOSTS))
        return None

    def safe_addresses(self) -> set[str]:
        return {
            self.dead_address,
            "",
            "127.0.0.1",
            "127.0.0.1:",
            "127.0.0.1:0",
            "127.0.0.1:99999",
            "[::1]:1",
            "127.0.0.1:-5",
            ":" * 5,
            "127.0.0.1:" + "9" * 30,
        }

    def raw_is_safe(self, cls: type[Message], body: bytes) -> bool:
        """Whether a mutated body, if it parses, still names only loopback addresses and sandboxed paths.

        A bit flip can turn ``127.0.0.1:port`` into a host name (the JobManager would resolve it
        through the network's DNS server) or a sandbox path into ``/tmp/...``-elsewhere.
        """
        try:
            msg = cls.FromString(body)
        except Exception:
            return True  # refused by the server's parser too
        ok = True
        sandbox_root = os.path.realpath(self.sandbox.parents[2])
        cwd = os.path.join(os.path.realpath(self.sandbox.parents[3]), "cwd")
        addresses = self.safe_addresses()

        def check(m: Message) -> None:
            nonlocal ok
            for field_d, value in m.ListFields():
                if field_d.type == FD.TYPE_MESSAGE and not ps.message_type(field_d).GetOptions().map_entry:
                    for item in value if field_d.is_repeated else [value]:
                        check(item)
                elif field_d.type == FD.TYPE_STRING and not field_d.is_repeated:
                    if (is_address_field(field_d.name) and value not in addresses) or (
                        is_host_field(field_d.name) and value not in SAFE_HOSTS
                    ):
                        ok = False
                    if field_d.name in PATH_FIELDS and value and value != self.checkpoint_path:
                        local = value.removeprefix("file://")
                        if "://" in local or not os.path.normpath(os.path.join(cwd, local)).startswith(
                            sandbox_root + "/"
                        ):
                            ok = False

        check(msg)
        return ok

    def protect(self, method_name: str, msg: Message) -> None:
        """Keep the reference job, and the real TaskManagers' registrations, out of the fuzzer's reach."""
        protected = {REF_JOB}
        if method_name in TM_LIFECYCLE_METHODS:
            protected |= set(self.tm_ids)
        _rewrite_strings(msg, lambda s: s + "-fz" if s in protected else s)

    # -- valid requests --------------------------------------------------------------------
    def target(self, subtask: int, kind: str) -> tm_pb.StateTarget:
        assert self.routing is not None
        return tm_pb.StateTarget(
            job_id=self.job,
            operator_id=FUZZ_OPERATOR,
            subtask_index=subtask,
            state_name=STATES[kind],
            routing_version=self.routing.version,
        )

    def address_of(self, subtask: int) -> str:
        assert self.routing is not None
        return self.routing.operator(FUZZ_OPERATOR).addresses[subtask]

    def template(self, service: str, method: str, subtask: int) -> tuple[Message, str] | None:
        """A valid request for ``method`` against the fuzz job, and the address to send it to."""
        if self.routing is None:
            return None
        subtask %= len(self.keys)
        builder = _TEMPLATES.get((service.rsplit(".", 1)[-1], method))
        if builder is None:
            return None
        return builder(self, subtask)


def _rewrite_strings(msg: Message, fn: Callable[[str], str]) -> None:
    for field_d, value in msg.ListFields():
        if field_d.type == FD.TYPE_MESSAGE:
            if ps.message_type(field_d).GetOptions().map_entry:
                container = getattr(msg, field_d.name)
                for k in list(container.keys()):
                    if isinstance(k, str) and fn(k) != k:
                        v = container[k]
                        del container[k]
                        if not isinstance(v, Message):
                            container[fn(k)] = v
                if ps.message_type(field_d).fields_by_name["value"].type == FD.TYPE_STRING:
                    for k in list(container.keys()):
                        container[k] = fn(container[k])
            elif field_d.is_repeated:
                for item in value:
                    _rewrite_strings(item, fn)
            else:
                _rewrite_strings(value, fn)
        elif field_d.type == FD.TYPE_STRING:
            if field_d.is_repeated:
                value[:] = [fn(v) for v in value]
            else:
                setattr(msg, field_d.name, fn(value))


# -- templates ---------------------------------------------------------------------------------


def _keyed(kind: str, **columns: Callable[[list[bytes]], list[bytes]]) -> Callable[[World, int], tuple[Message, str]]:
    def build(w: World, s: int) -> tuple[Message, str]:
        keys = w.keys[s]
        fields: dict[str, Any] = {name: make(keys) for name, make in columns.items()}
        if s % 2:
            # Subtask 1's templates use the columnar wire (version 2), so mutations break packed columns too.
            request = tm_pb.KeyedRequest(target=w.target(s, kind))
            for name, items in {"keys": keys, **fields}.items():
                getattr(request, f"packed_{name}").CopyFrom(_packed(items))
            return request, w.address_of(s)
        return tm_pb.KeyedRequest(target=w.target(s, kind), keys=keys, **fields), w.address_of(s)

    return build


def _packed(items: list[bytes]) -> tm_pb.PackedBytes:
    offsets, data = pack(items)
    return tm_pb.PackedBytes(offsets=offsets, data=data)


def _scan(kind: str, has_key: bool) -> Callable[[World, int], tuple[Message, str]]:
    def build(w: World, s: int) -> tuple[Message, str]:
        return tm_pb.ScanRequest(
            target=w.target(s, kind), has_key=has_key, key=w.keys[s][0] if has_key else b"", chunk_size=2
        ), w.address_of(s)

    return build


def _values(keys: list[bytes]) -> list[bytes]:
    return [b"val-" + k for k in keys]


def _user_keys(keys: list[bytes]) -> list[bytes]:
    return [b"uk-" + k for k in keys]


def _vectors(keys: list[bytes]) -> list[bytes]:
    return [REDUCE_FORMAT.pack(1, 2) for _ in keys]


def _spec(w: World) -> pb.OperatorSpec:
    return operator_spec_to_proto(fuzz_operators()[0])


def _deploy(w: World, s: int) -> tuple[Message, str]:
    assert w.routing is not None
    groups = [g for g, owner in enumerate(w.routing.operator(FUZZ_OPERATOR).subtask_of) if owner == s]
    return tm_pb.DeploySlotRequest(
        job_id=w.job,
        operator=_spec(w),
        subtask_index=s,
        key_groups=pb.KeyGroupRange(start=groups[0], end=groups[-1]),
        max_parallelism=w.routing.max_parallelism,
        slot_index=0,
        routing_version=w.live_routing().version,
        checkpoint_base=w.sandbox_path(w.job),
        incremental=True,
    ), w.address_of(s)


_TEMPLATES: dict[tuple[str, str], Callable[[World, int], tuple[Message, str]]] = {
    ("KeyedState", "ValueGet"): _keyed("value"),
    ("KeyedState", "ValuePut"): _keyed("value", values=_values),
    ("KeyedState", "Clear"): _keyed("list"),
    ("KeyedState", "Reduce"): _keyed("reducing", values=_vectors),
    ("KeyedState", "ListAppend"): _keyed("list", values=_values),
    ("KeyedState", "ListGet"): _keyed("list"),
    ("KeyedState", "ListUpdate"): _keyed("list", values=_values),
    ("KeyedState", "ListScan"): _scan("list", True),
    ("KeyedState", "MapPut"): _keyed("map", user_keys=_user_keys, values=_values),
    ("KeyedState", "MapGet"): _keyed("map", user_keys=_user_keys),
    ("KeyedState", "MapRemove"): _keyed("map", user_keys=_user_keys),
    ("KeyedState", "MapContains"): _keyed("map", user_keys=_user_keys),
    ("KeyedState", "MapScan"): _scan("map", True),
    ("KeyedState", "ScanKeys"): _scan("value", False),
    ("TaskExecutor", "DeploySlot"): _deploy,
    ("TaskExecutor", "ReleaseSlot"): lambda w, s: (
        tm_pb.ReleaseSlotRequest(
            job_id=w.job, operator_id=FUZZ_OPERATOR, subtask_index=s, routing_version=w.live_routing().version
        ),
        w.address_of(s),
    ),
    ("TaskExecutor", "TriggerCheckpoint"): lambda w, s: (
        tm_pb.CheckpointBarrier(
            job_id=w.job,
            checkpoint_id=1000 + w.generation,
            timestamp_ms=1,
            target_path=w.sandbox_path(f"{w.job}/chk-x"),
            incremental=True,
            epoch=-1,
        ),
        w.address_of(s),
    ),
    ("TaskExecutor", "NotifyCheckpoint"): lambda w, s: (
        tm_pb.CheckpointNotification(job_id=w.job, checkpoint_id=1000 + w.generation, completed=bool(s)),
        w.address_of(s),
    ),
    ("TaskExecutor", "CommitEpoch"): lambda w, s: (
        tm_pb.EpochCommitRequest(
            job_id=w.job,
            epoch=0,
            routing_version=w.live_routing().version,
            prepare=True,
            winners=[pb.PartitionAttempt(partition=0, attempt=1)],
        ),
        w.address_of(s),
    ),
    ("ResourceManager", "RegisterTaskManager"): lambda w, s: (
        jm_pb.RegisterTaskManagerRequest(
            taskmanager_id=f"fz-tm-{s}", address=w.dead_address, num_slots=1, host="127.0.0.1", backend="hashmap"
        ),
        w.jm_address,
    ),
    ("ResourceManager", "Heartbeat"): lambda w, s: (
        jm_pb.HeartbeatRequest(taskmanager_id=f"fz-tm-{s}", jobmanager_session=w.session),
        w.jm_address,
    ),
    ("ResourceManager", "DeregisterTaskManager"): lambda w, s: (
        jm_pb.DeregisterTaskManagerRequest(taskmanager_id=f"fz-tm-{s}"),
        w.jm_address,
    ),
    # A TaskManager that does not run the subtask, under the current deployment: refused after the job,
    # operator and subtask checks (FAILED_PRECONDITION), so the fuzz job is never failed over.
    ("ResourceManager", "ReportTaskFailure"): lambda w, s: (
        jm_pb.ReportTaskFailureRequest(
            job_id=w.job,
            taskmanager_id=f"fz-tm-{s}",
            operator_id=FUZZ_OPERATOR,
            subtask_index=s,
            routing_version=w.live_routing().version,
            cause="fuzz",
        ),
        w.jm_address,
    ),
    ("JobManager", "SubmitJob"): lambda w, s: (
        jm_pb.SubmitJobRequest(
            job_id=f"fz-sub-{s}",
            operators=[operator_spec_to_proto(fuzz_operators(parallelism=1)[0])],
            max_parallelism=16,
        ),
        w.jm_address,
    ),
    # Cancels the fuzz job itself (the fz-sub jobs rarely deploy: the fake TaskManagers take their
    # slots); the next refresh submits a new one.
    ("JobManager", "CancelJob"): lambda w, s: (jm_pb.JobRequest(job_id=w.job), w.jm_address),
    ("JobManager", "GetJob"): lambda w, s: (jm_pb.JobRequest(job_id=w.job), w.jm_address),
    ("JobManager", "GetRouting"): lambda w, s: (jm_pb.GetRoutingRequest(job_id=w.job, known_version=s), w.jm_address),
    ("JobManager", "GetClusterOverview"): lambda w, s: (jm_pb.ClusterOverviewRequest(), w.jm_address),
    ("JobManager", "TriggerCheckpoint"): lambda w, s: (
        jm_pb.TriggerCheckpointRequest(
            job_id=w.job,
            savepoint=bool(s),
            target_directory=w.sandbox_path("savepoints") if s else "",
            wait=True,
            timeout_ms=2_000,
        ),
        w.jm_address,
    ),
    ("CheckpointCoordinatorGateway", "AcknowledgeCheckpoint"): lambda w, s: (
        jm_pb.AcknowledgeCheckpointRequest(
            job_id=w.job,
            checkpoint_id=1,
            taskmanager_id=w.tm_ids[s % len(w.tm_ids)],
            state=pb.SubtaskStateHandle(
                operator_id=FUZZ_OPERATOR,
                subtask_index=s,
                backend="rocksdb",
                files=[
                    pb.StateFileHandle(
                        path=f"{FUZZ_OPERATOR}-{s}/_snapshot.json", size=3, sha256="0" * 64, local_name="_snapshot.json"
                    )
                ],
            ),
        ),
        w.jm_address,
    ),
    ("CheckpointCoordinatorGateway", "DeclineCheckpoint"): lambda w, s: (
        jm_pb.DeclineCheckpointRequest(
            job_id=w.job,
            checkpoint_id=1,
            taskmanager_id=w.tm_ids[s % len(w.tm_ids)],
            operator_id=FUZZ_OPERATOR,
            subtask_index=s,
            message="fuzz",
            reason=jm_pb.DECLINE_REASON_SNAPSHOT_FAILED,
        ),
        w.jm_address,
    ),
    ("JobManager", "ListCheckpoints"): lambda w, s: (jm_pb.JobRequest(job_id=w.job), w.jm_address),
    ("JobManager", "BeginBatch"): lambda w, s: (
        jm_pb.BeginBatchRequest(job_id=w.job, query_id="q", batch_id=s),
        w.jm_address,
    ),
    ("JobManager", "CommitEpoch"): lambda w, s: (
        jm_pb.CommitEpochRequest(
            job_id=w.job,
            epoch=0,
            expected_routing_version=w.live_routing().version,
            query_id="q",
            batch_id=0,
            winners=[pb.PartitionAttempt(partition=0, attempt=1)],
            checkpoint=bool(s),
            wait_for_checkpoint=bool(s),
            timeout_ms=2_000,
        ),
        w.jm_address,
    ),
    ("JobManager", "RestoreJob"): lambda w, s: (
        jm_pb.RestoreJobRequest(job_id=w.job, restore_path=w.checkpoint_path or w.sandbox_path("none")),
        w.jm_address,
    ),
    ("JobManager", "RescaleJob"): lambda w, s: (
        jm_pb.RescaleJobRequest(job_id=w.job, parallelism={"": 1 + s}),
        w.jm_address,
    ),
}


# -- breaking one field ------------------------------------------------------------------------


def _fields_of(msg: Message, path: tuple[str, ...] = ()) -> list[tuple[Message, d.FieldDescriptor]]:
    """Every (message, field) in ``msg``'s tree: set or not, nested in set sub-messages."""
    out: list[tuple[Message, d.FieldDescriptor]] = []
    for field_d in cast(d.Descriptor, msg.DESCRIPTOR).fields:
        out.append((msg, field_d))
        if field_d.type == FD.TYPE_MESSAGE and not ps.message_type(field_d).GetOptions().map_entry:
            repeated = field_d.is_repeated
            if repeated:
                for item in getattr(msg, field_d.name):
                    out.extend(_fields_of(item))
            elif msg.HasField(field_d.name):
                out.extend(_fields_of(getattr(msg, field_d.name)))
    return out


@st.composite
def broken(draw: st.DrawFn, valid: Message, override: ps.FieldOverride) -> Message:
    """``valid`` with one field (anywhere in its tree) replaced by a generated value."""
    msg = type(valid)()
    msg.CopyFrom(valid)
    candidates = _fields_of(msg)
    if not candidates:
        return msg
    parent, field_d = draw(st.sampled_from(candidates))
    if field_d.type == FD.TYPE_MESSAGE:
        element = ps.message_strategy(ps.message_type(field_d), max_depth=2, override=override)
    else:
        chosen = override(field_d)
        element = chosen if chosen is not None else ps.scalar_strategy(field_d)
    if field_d.type == FD.TYPE_MESSAGE and ps.message_type(field_d).GetOptions().map_entry:
        container = getattr(parent, field_d.name)
        key_f, value_f = (
            ps.message_type(field_d).fields_by_name["key"],
            ps.message_type(field_d).fields_by_name["value"],
        )
        container[draw(ps.scalar_strategy(key_f))] = draw(ps.scalar_strategy(value_f))
        return msg
    if field_d.is_repeated:
        container = getattr(parent, field_d.name)
        action = draw(st.sampled_from(["append", "replace", "clear", "many"]))
        if action == "clear" or (action == "replace" and not len(container)):
            del container[:]
        elif action == "replace":
            i = draw(st.integers(0, len(container) - 1))
            value = draw(element)
            if field_d.type == FD.TYPE_MESSAGE:
                container[i].CopyFrom(value)
            else:
                container[i] = value
        elif action == "many":
            # Many (small) entries: a batch far above what the test normally sends.
            n = draw(st.sampled_from([100, 5000]))
            if field_d.type == FD.TYPE_MESSAGE:
                one = draw(ps.message_strategy(ps.message_type(field_d), max_depth=2, override=override, huge=False))
                for _ in range(n):
                    container.add().CopyFrom(one)
            else:
                chosen = override(field_d)
                container.extend([draw(chosen if chosen is not None else ps.scalar_strategy(field_d, huge=False))] * n)
        elif field_d.type == FD.TYPE_MESSAGE:
            container.add().CopyFrom(draw(element))
        else:
            container.append(draw(element))
        return msg
    if field_d.type == FD.TYPE_MESSAGE:
        if draw(st.booleans()):
            parent.ClearField(field_d.name)
        else:
            getattr(parent, field_d.name).CopyFrom(draw(element))
        return msg
    setattr(parent, field_d.name, draw(element))
    return msg
