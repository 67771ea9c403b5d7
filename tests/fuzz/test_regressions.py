"""Minimized reproducers of what the fuzzers found, as plain tests against real daemons."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, cast

import grpc
import pytest

from keyedstate.common._proto.v1 import common_pb2 as pb
from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common._proto.v1 import jobmanager_pb2_grpc as jm_grpc
from keyedstate.common._proto.v1 import taskmanager_pb2 as tm_pb
from keyedstate.common._proto.v1 import taskmanager_pb2_grpc as tm_grpc
from keyedstate.common.config.options import MAX_TASK_SLOTS
from keyedstate.common.descriptors import OperatorSpec, StateDescriptor, StateKind
from keyedstate.common.rpc.descriptors import operator_spec_to_proto
from keyedstate.common.rpc.status import MAX_DETAILS_WIRE_BYTES, REASON_KEY, bounded_details


def _error(call: Any) -> grpc.Call:
    try:
        call()
    except grpc.RpcError as exc:
        return cast(grpc.Call, exc)  # a failed call's error is also the grpc.Call (code, details, trailers)
    raise AssertionError("the call succeeded; expected a gRPC error")


def _reason(err: grpc.Call) -> str | bytes | None:
    return dict(err.trailing_metadata() or ()).get(REASON_KEY)


def _raw_unary(channel: grpc.Channel, path: str) -> grpc.UnaryUnaryMultiCallable[bytes, bytes]:
    """A unary call without (de)serializers: the request bytes go over the wire as they are."""
    return channel.unary_unary(path)


def _raw_stream(channel: grpc.Channel, path: str) -> grpc.UnaryStreamMultiCallable[bytes, bytes]:
    """A server-streaming call without (de)serializers: the request bytes go over the wire as they are."""
    return channel.unary_stream(path)


@pytest.fixture
def cluster(inprocess_cluster: Any) -> Any:
    c = inprocess_cluster(taskmanagers=1, slots=2, backend="hashmap")
    c.client().submit_job("j", [OperatorSpec("op", 1, (StateDescriptor("v", StateKind.VALUE),))])
    return c


@pytest.mark.parametrize(
    "body",
    [b"\n", b"\xff\xa3l\xe16:", b"\n\x06ok\xff\xfe\xc3(", b"\n\x08fuzz"],
    ids=["truncated", "garbage", "invalid-utf8", "short-string"],
)
def test_a_request_that_is_not_protobuf_is_invalid_argument_not_internal(cluster: Any, body: bytes) -> None:
    """gRPC answered INTERNAL "Exception deserializing request!", which reads as a server bug."""
    tm_address = cluster.taskmanagers[0].address
    with grpc.insecure_channel(cluster.address) as jm, grpc.insecure_channel(tm_address) as tm:
        calls: list[Callable[[], object]] = [
            lambda: _raw_unary(jm, "/keyedstate.v1.JobManager/GetJob")(body, timeout=10),
            lambda: _raw_unary(tm, "/keyedstate.v1.KeyedState/ValuePut")(body, timeout=10),
            lambda: _raw_unary(tm, "/keyedstate.v1.TaskExecutor/DeploySlot")(body, timeout=10),
            lambda: list(_raw_stream(tm, "/keyedstate.v1.KeyedState/ScanKeys")(body, timeout=10)),
        ]
        for call in calls:
            err = _error(call)
            assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, err.details()
            assert _reason(err) == "INVALID_ARGUMENT"
            assert "not a valid protobuf message" in err.details() and "keyedstate.v1" in err.details()
        # Still serving: a valid call answers.
        assert (
            jm_grpc.JobManagerStub(jm).GetJob(jm_pb.JobRequest(job_id="j"), timeout=10).status == pb.JOB_STATUS_RUNNING
        )


def test_a_taskmanager_offering_two_billion_slots_is_refused_at_once(cluster: Any) -> None:
    """The registry allocated one entry per offered slot: 2^31-1 slots hung the JobManager (16 GiB list)."""
    with grpc.insecure_channel(cluster.address) as channel:
        stub = jm_grpc.ResourceManagerStub(channel)
        t0 = time.monotonic()
        err = _error(
            lambda: stub.RegisterTaskManager(
                jm_pb.RegisterTaskManagerRequest(
                    taskmanager_id="fz-tm-0",
                    address="127.0.0.1:1",
                    num_slots=2**31 - 1,
                    host="127.0.0.1",
                    backend="hashmap",
                ),
                timeout=10,
            )
        )
        assert time.monotonic() - t0 < 2
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and _reason(err) == "INVALID_ARGUMENT"
        assert "taskmanager.numberOfTaskSlots" in err.details() and str(MAX_TASK_SLOTS) in err.details()
        overview = jm_grpc.JobManagerStub(channel).GetClusterOverview(jm_pb.ClusterOverviewRequest(), timeout=10)
        assert [t.taskmanager_id for t in overview.taskmanagers] == ["tm-0"]


def test_an_error_echoing_a_huge_name_keeps_its_status_and_reason(cluster: Any) -> None:
    """A 1 MiB state name came back in the message; the client dropped the answer as RESOURCE_EXHAUSTED
    ("metadata size exceeds hard limit") and lost the status code and the reason."""
    routing = cluster.client().routing("j")
    with grpc.insecure_channel(routing.operator("op").addresses[0]) as channel:
        stub = tm_grpc.KeyedStateStub(channel)
        target = tm_pb.StateTarget(
            job_id="j", operator_id="op", subtask_index=0, state_name="y" * (1 << 20), routing_version=routing.version
        )
        err = _error(lambda: stub.ValueGet(tm_pb.KeyedRequest(target=target, keys=[b"k"]), timeout=10))
        assert err.code() is grpc.StatusCode.NOT_FOUND, err.details()
        assert _reason(err) == "UNKNOWN_STATE"
        assert "characters cut" in err.details() and err.details().endswith("the operator declares: v")


def test_bounded_details_keeps_short_messages_and_cuts_long_ones_to_the_header_budget() -> None:
    assert bounded_details("unknown job 'x'") == "unknown job 'x'"
    for filler in ("y", "\x00", "ü", "\U0001f600"):
        message = f"unknown state {filler * 100_000!r}; declare it first"
        cut = bounded_details(message)
        encoded = sum(1 if 0x20 <= b <= 0x7E and b != 0x25 else 3 for b in cut.encode())
        assert encoded <= MAX_DETAILS_WIRE_BYTES
        assert cut.startswith("unknown state") and cut.endswith("declare it first")


def test_a_duplicate_barrier_of_a_running_checkpoint_is_ignored(cluster: Any, tmp_path: Any) -> None:
    """A second barrier with the same id deleted the local snapshot the first one was uploading:
    INTERNAL (FileNotFoundError in rmtree) and a failed checkpoint."""
    tm = cluster.taskmanagers[0]
    with grpc.insecure_channel(tm.address) as channel:
        stub = tm_grpc.TaskExecutorStub(channel)
        barrier = tm_pb.CheckpointBarrier(
            job_id="j", checkpoint_id=77, timestamp_ms=1, target_path=(tmp_path / "chk-77").as_uri(), epoch=-1
        )
        first = stub.TriggerCheckpoint(barrier, timeout=10)
        answers = [stub.TriggerCheckpoint(barrier, timeout=10) for _ in range(5)]
        assert first.slots == 1 and [a.slots for a in answers] == [1] * 5
        deadline = time.monotonic() + 10
        manifest = tmp_path / "chk-77" / "op-0" / "_snapshot.json"
        while not manifest.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert manifest.exists(), "the first barrier's upload did not complete"
        # After it completed (notified) the same id may be taken again.
        tm_grpc.TaskExecutorStub(channel).NotifyCheckpoint(
            tm_pb.CheckpointNotification(job_id="j", checkpoint_id=77, completed=False), timeout=10
        )
        assert stub.TriggerCheckpoint(barrier, timeout=10).slots == 1


def test_a_barrier_for_a_job_without_slots_here_leaves_nothing_behind(cluster: Any, tmp_path: Any) -> None:
    """Hostile barriers for unknown jobs must not accumulate in-flight entries (unbounded memory)."""
    tm = cluster.taskmanagers[0]
    with grpc.insecure_channel(tm.address) as channel:
        stub = tm_grpc.TaskExecutorStub(channel)
        for i in range(50):
            assert (
                stub.TriggerCheckpoint(
                    tm_pb.CheckpointBarrier(job_id=f"nojob{i}", checkpoint_id=1, target_path=(tmp_path / "x").as_uri()),
                    timeout=10,
                ).slots
                == 0
            )
    assert not any(job.startswith("nojob") for job, _ in tm.checkpoints._inflight)


# -- checkpoint readers ------------------------------------------------------------------------


def _metadata_doc() -> dict[str, Any]:
    return {
        "format": "keyedstate-checkpoint",
        "version": 1,
        "job_id": "j",
        "checkpoint_id": 3,
        "savepoint": False,
        "timestamp_ms": 1,
        "epoch": -1,
        "lineage": [],
        "max_parallelism": 4,
        "operators": [
            {
                "operator_id": "op",
                "parallelism": 1,
                "states": [{"name": "v", "kind": "value", "ttl": None, "reduce_fields": []}],
                "subtasks": [
                    {
                        "subtask_index": 0,
                        "key_groups": [0, 3],
                        "backend": "hashmap",
                        "committed_epoch": -1,
                        "full_size": 1,
                        "incremental_size": 1,
                        "files": [
                            {
                                "path": "op-0/meta.kvs",
                                "size": 1,
                                "sha256": "0" * 64,
                                "local_name": "meta.kvs",
                                "shared": False,
                            }
                        ],
                    }
                ],
            }
        ],
    }


@pytest.mark.parametrize(
    "data",
    [
        b'{"format":"keyedstate-checkpoint","version":1,"checkpoint_id":' + b"9" * 5000 + b"}",
        b"[" * 200_000 + b"]" * 200_000,
    ],
    ids=["5000-digit-integer", "nested-200000-deep"],
)
def test_metadata_that_python_cannot_parse_is_a_corrupt_checkpoint(data: bytes) -> None:
    """json.loads raised ValueError (int-conversion limit) or RecursionError, untyped: recovery
    (find_latest_checkpoint) only skips CorruptCheckpointError, so one such file broke it."""
    from keyedstate.common.errors import CorruptCheckpointError
    from keyedstate.jobmanager.checkpoint.metadata import CheckpointMetadata

    with pytest.raises(CorruptCheckpointError, match="not valid UTF-8 JSON"):
        CheckpointMetadata.from_json(data, source="chk-3/_metadata")


@pytest.mark.parametrize("local_name", ["../../../../../../tmp/escaped", "..", "a/b", "x\x00y", "/abs"])
def test_metadata_with_a_local_name_that_is_not_a_plain_file_name_is_refused(local_name: str) -> None:
    """local_name was not checked: a restore writes the file under it, outside the restore directory."""
    import json as json_module

    from keyedstate.common.errors import CorruptCheckpointError
    from keyedstate.jobmanager.checkpoint.metadata import CheckpointMetadata

    doc = _metadata_doc()
    assert CheckpointMetadata.from_json(json_module.dumps(doc)).checkpoint_id == 3
    doc["operators"][0]["subtasks"][0]["files"][0]["local_name"] = local_name
    with pytest.raises(CorruptCheckpointError, match="not a plain file name"):
        CheckpointMetadata.from_json(json_module.dumps(doc))


def test_metadata_without_local_name_restores_under_the_paths_last_part_which_must_be_plain() -> None:
    import json as json_module

    from keyedstate.common.errors import CorruptCheckpointError
    from keyedstate.jobmanager.checkpoint.metadata import CheckpointMetadata

    doc = _metadata_doc()
    entry = doc["operators"][0]["subtasks"][0]["files"][0]
    entry["local_name"] = ""
    assert CheckpointMetadata.from_json(json_module.dumps(doc)).checkpoint_id == 3  # restores as meta.kvs
    entry["path"] = "op-0/meta\x00.kvs"
    with pytest.raises(CorruptCheckpointError, match="not a plain file name"):
        CheckpointMetadata.from_json(json_module.dumps(doc))


@pytest.mark.parametrize("field", ["committed_epoch", "full_size", "incremental_size"])
def test_metadata_integers_outside_int64_are_a_corrupt_checkpoint(field: str) -> None:
    """committed_epoch=65494308061327581470640513744896 loaded, then plan_restore's protobuf handle raised
    ValueError('Value out of range'), untyped. Found by the long checkpoint-reader run."""
    import json as json_module

    from keyedstate.common.errors import CorruptCheckpointError
    from keyedstate.jobmanager.checkpoint.metadata import CheckpointMetadata

    doc = _metadata_doc()
    doc["operators"][0]["subtasks"][0][field] = 65494308061327581470640513744896
    with pytest.raises(CorruptCheckpointError, match="outside the 64-bit range"):
        CheckpointMetadata.from_json(json_module.dumps(doc))
    doc["operators"][0]["subtasks"][0][field] = 2**63 - 1
    CheckpointMetadata.from_json(json_module.dumps(doc))


def test_metadata_with_a_path_no_file_system_holds_is_corrupt_not_a_storage_error() -> None:
    """A 10,000-character file name in _metadata failed verify_files_exist with StorageError (ENAMETOOLONG:
    UNAVAILABLE, "retry") instead of naming the corrupt checkpoint. Found by the long checkpoint-reader run."""
    import json as json_module

    from keyedstate.common.errors import CorruptCheckpointError
    from keyedstate.jobmanager.checkpoint.metadata import CheckpointMetadata

    doc = _metadata_doc()
    doc["operators"][0]["subtasks"][0]["files"][0]["path"] = "x" * 10_000
    doc["operators"][0]["subtasks"][0]["files"][0]["local_name"] = "meta.kvs"
    with pytest.raises(CorruptCheckpointError, match="longer than a file system allows"):
        CheckpointMetadata.from_json(json_module.dumps(doc))


def _deploy_restoring(cluster: Any, tmp_path: Any, job_id: str, operator_id: str, local_name: str) -> grpc.Call:
    """DeploySlot restoring one verified file (right size and sha256) under the given handle names; the refusal."""
    import hashlib

    from keyedstate.common._proto.v1 import common_pb2 as pb

    remote = tmp_path / "remote" / "meta.kvs"
    remote.parent.mkdir(exist_ok=True)
    remote.write_bytes(b"payload")
    handle = pb.SubtaskStateHandle(
        operator_id=operator_id,
        subtask_index=0,
        key_groups=pb.KeyGroupRange(start=0, end=127),
        backend="hashmap",
        files=[
            pb.StateFileHandle(
                path=remote.as_uri(), size=7, sha256=hashlib.sha256(b"payload").hexdigest(), local_name=local_name
            )
        ],
    )
    request = tm_pb.DeploySlotRequest(
        job_id=job_id,
        operator=operator_spec_to_proto(OperatorSpec("op2", 1, (StateDescriptor("v", StateKind.VALUE),))),
        subtask_index=0,
        key_groups=pb.KeyGroupRange(start=0, end=127),
        max_parallelism=128,
        slot_index=1,
        routing_version=1,
        restore=tm_pb.SlotRestore(checkpoint_path=remote.parent.as_uri(), handles=[handle], checkpoint_id=1),
    )
    with grpc.insecure_channel(cluster.taskmanagers[0].address) as channel:
        return _error(lambda: tm_grpc.TaskExecutorStub(channel).DeploySlot(request, timeout=30))


def _depth_to(cluster: Any, tmp_path: Any) -> int:
    """How many ``..`` lead from a restore directory of the first TaskManager up to ``tmp_path``."""
    return len(cluster.taskmanagers[0].deployer.work_dir.relative_to(tmp_path).parts) + 2


def test_deploy_slot_refuses_a_restore_file_whose_local_name_leaves_the_restore_directory(
    cluster: Any, tmp_path: Any
) -> None:
    """DeploySlot with a restore handle naming ``local_name='../../../<x>'`` downloaded the (verified)
    file to that path: a write anywhere the TaskManager may write."""
    escaped = tmp_path / "escaped-by-restore"
    err = _deploy_restoring(cluster, tmp_path, "evil", "op2", "../" * _depth_to(cluster, tmp_path) + escaped.name)
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert "plain file name" in err.details()
    assert not escaped.exists() and not list(tmp_path.glob("**/escaped-by-restore*"))


def test_deploy_slot_refuses_a_restore_handle_whose_operator_id_leaves_the_restore_directory(
    cluster: Any, tmp_path: Any
) -> None:
    """A restore handle's operator id ``x/../../../escaped-dir`` was joined into the restore
    directory's path: the TaskManager made ``escaped-dir-0/meta.kvs`` outside its directory (the
    deploy failed, the files stayed). Reported by the RPC fuzz run."""
    err = _deploy_restoring(
        cluster, tmp_path, "evil2", "x/" + "../" * _depth_to(cluster, tmp_path) + "escaped-dir", "meta.kvs"
    )
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert "operator id of a restore handle" in err.details() and "path separator" in err.details()
    assert not list(tmp_path.glob("**/escaped-dir*"))


@pytest.mark.parametrize("timeout_ms", [2**62, -1, 86_400_001])
def test_a_wait_beyond_what_the_clock_can_represent_is_invalid_argument(cluster: Any, timeout_ms: int) -> None:
    """TriggerCheckpoint(wait=true, timeout_ms=2^62) raised OverflowError ("timestamp out of range for
    platform time_t") in the wait: INTERNAL. Found by the long RPC fuzz run."""
    with grpc.insecure_channel(cluster.address) as channel:
        stub = jm_grpc.JobManagerStub(channel)
        err = _error(
            lambda: stub.TriggerCheckpoint(
                jm_pb.TriggerCheckpointRequest(job_id="j", wait=True, timeout_ms=timeout_ms), timeout=10
            )
        )
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and _reason(err) == "INVALID_ARGUMENT", err.details()
        assert "timeout_ms must be between 0" in err.details()
        err = _error(
            lambda: stub.CommitEpoch(
                jm_pb.CommitEpochRequest(
                    job_id="j", epoch=0, expected_routing_version=1, wait_for_checkpoint=True, timeout_ms=timeout_ms
                ),
                timeout=10,
            )
        )
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and "timeout_ms must be between 0" in err.details()
        ok = stub.TriggerCheckpoint(
            jm_pb.TriggerCheckpointRequest(job_id="j", wait=True, timeout_ms=30_000), timeout=40
        )
        assert ok.status == jm_pb.CHECKPOINT_STATUS_COMPLETED, ok.failure_reason


@pytest.mark.parametrize("slot_index", [-210, -1, 2, 2**31 - 1])
def test_a_heartbeat_reporting_a_slot_the_taskmanager_does_not_offer_is_refused(cluster: Any, slot_index: int) -> None:
    """Heartbeat with SlotReport(slot_index=-210) raised IndexError in the JobManager (INTERNAL);
    -1 silently addressed the last slot. Found by the long RPC fuzz run."""
    with grpc.insecure_channel(cluster.address) as channel:
        rm = jm_grpc.ResourceManagerStub(channel)
        session = rm.RegisterTaskManager(
            jm_pb.RegisterTaskManagerRequest(
                taskmanager_id="fz-tm-1", address="127.0.0.1:1", num_slots=2, host="127.0.0.1", backend="hashmap"
            ),
            timeout=10,
        ).jobmanager_session
        report = jm_pb.SlotReport(slot_index=slot_index, job_id="a", operator_id="b", subtask_index=0)
        err = _error(
            lambda: rm.Heartbeat(
                jm_pb.HeartbeatRequest(taskmanager_id="fz-tm-1", slots=[report], jobmanager_session=session), timeout=10
            )
        )
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and _reason(err) == "INVALID_ARGUMENT", err.details()
        assert "offers 2 slots (0..1)" in err.details()
        assert rm.Heartbeat(
            jm_pb.HeartbeatRequest(taskmanager_id="fz-tm-1", jobmanager_session=session), timeout=10
        ).known


@pytest.mark.parametrize(
    "field,value",
    [
        ("address", ":::::"),
        ("address", "127.0.0.1:0"),
        ("address", "127.0.0.1:99999"),
        ("address", "127.0.0.1:-5"),
        ("address", "127.0.0.1"),
        ("address", "a b:1"),
        ("internal_address", "0"),
        ("internal_address", "host:port"),
    ],
)
def test_a_taskmanager_address_that_is_not_host_and_port_is_refused(cluster: Any, field: str, value: str) -> None:
    """RegisterTaskManager(address=':::::', internal_address='0') was accepted: the TaskManager took slots, every
    deploy to it failed, and the JobManager sent '0' to the DNS resolver. Found by the long RPC fuzz run."""
    with grpc.insecure_channel(cluster.address) as channel:
        rm = jm_grpc.ResourceManagerStub(channel)
        request = jm_pb.RegisterTaskManagerRequest(
            taskmanager_id="fz-tm-2", address="127.0.0.1:1", num_slots=1, host="127.0.0.1", backend="hashmap"
        )
        setattr(request, field, value)
        err = _error(lambda: rm.RegisterTaskManager(request, timeout=10))
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and _reason(err) == "INVALID_ARGUMENT", err.details()
        assert f"sent {field}" in err.details() and "port in 1..65535" in err.details()
        overview = jm_grpc.JobManagerStub(channel).GetClusterOverview(jm_pb.ClusterOverviewRequest(), timeout=10)
        assert [t.taskmanager_id for t in overview.taskmanagers] == ["tm-0"]


def test_a_task_failure_report_is_checked_against_the_deployment(cluster: Any) -> None:
    """ReportTaskFailure failed any job over for any caller: a report naming an unknown operator, a
    subtask past the parallelism, or a TaskManager that does not run the subtask now is refused (found
    by the RPC fuzzer: every answer was OK or NOT_FOUND); a report about an older deployment changes nothing."""
    with grpc.insecure_channel(cluster.address) as channel:
        rm = jm_grpc.ResourceManagerStub(channel)
        jm = jm_grpc.JobManagerStub(channel)
        job = jm.GetJob(jm_pb.JobRequest(job_id="j"), timeout=10)
        version = job.routing_version
        owner = jm.GetRouting(jm_pb.GetRoutingRequest(job_id="j"), timeout=10).routes[0].taskmanager_id

        def report(**fields: Any) -> jm_pb.ReportTaskFailureRequest:
            base: dict[str, Any] = {"job_id": "j", "taskmanager_id": owner, "operator_id": "op", "subtask_index": 0}
            return jm_pb.ReportTaskFailureRequest(**{**base, "routing_version": version, **fields, "cause": "test"})

        refused = [
            (report(operator_id="nope"), grpc.StatusCode.NOT_FOUND, "has no operator 'nope'"),
            (report(subtask_index=1), grpc.StatusCode.INVALID_ARGUMENT, "outside operator op's parallelism 1"),
            (report(subtask_index=-1), grpc.StatusCode.INVALID_ARGUMENT, "outside operator op's parallelism 1"),
            (report(taskmanager_id="someone-else"), grpc.StatusCode.FAILED_PRECONDITION, "does not run op[0]"),
            (report(routing_version=version + 1), grpc.StatusCode.FAILED_PRECONDITION, "does not run op[0]"),
        ]
        for request, code, text in refused:
            err = _error(lambda request=request: rm.ReportTaskFailure(request, timeout=10))
            assert err.code() is code and text in err.details(), err.details()
        rm.ReportTaskFailure(report(routing_version=version - 1), timeout=10)  # an older deployment: nothing
        time.sleep(0.5)  # the failover would run on the JobManager's pool, after the answer
        after = jm.GetJob(jm_pb.JobRequest(job_id="j"), timeout=10)
        assert after.status == pb.JOB_STATUS_RUNNING and after.restarts == job.restarts
        assert after.routing_version == version
        # The TaskManager running the subtask fails its job over.
        rm.ReportTaskFailure(report(), timeout=10)
        deadline = time.monotonic() + 30
        while jm.GetJob(jm_pb.JobRequest(job_id="j"), timeout=10).restarts == job.restarts:
            assert time.monotonic() < deadline, "the owner's report did not fail the job over"
            time.sleep(0.05)
