"""The REST API against a real cluster: every document carries the cluster's real values.

What each endpoint answers is compared with what the gRPC API (the same JobManager) says, and
the checkpoint documents with the checkpoints the test itself made: two completed, one failed
savepoint with its reason, and an ack with sync and async times for every subtask.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from keyedstate.common.descriptors import OperatorSpec
from tests.fixtures.cluster import InProcessCluster
from tests.fixtures.waiting import wait_for
from tests.integration.rest.conftest import (
    JOB,
    MAX_P,
    OPERATORS,
    OTHER_JOB,
    RestCluster,
    complete_checkpoint,
    write_keys,
)
from tests.integration.rest.test_openapi import check

SUBTASKS = sum(op.parallelism for op in OPERATORS)


def test_overview_and_taskmanagers_show_the_registered_slots(shared_rest_cluster: RestCluster) -> None:
    overview = shared_rest_cluster.get("/overview")
    assert overview.status == 200 and overview.headers["Content-Type"] == "application/json"
    cluster = shared_rest_cluster.client.cluster()
    assert overview.body["taskmanagers"] == 2 == len(cluster.taskmanagers)
    assert overview.body["slots-total"] == 8
    assert overview.body["slots-available"] == 8 - SUBTASKS == cluster.free_slots
    assert overview.body["jobs-running"] == 1

    tms = shared_rest_cluster.get("/taskmanagers").body["taskmanagers"]
    assert sorted(tm["id"] for tm in tms) == ["tm-0", "tm-1"]
    occupied = [s for tm in tms for s in tm["slots"] if not s["free"]]
    assert sorted((s["operatorId"], s["subtaskIndex"]) for s in occupied) == sorted(
        (op.operator_id, i) for op in OPERATORS for i in range(op.parallelism)
    )
    for tm in tms:
        assert tm["slotsNumber"] == 4 and tm["freeSlots"] == sum(s["free"] for s in tm["slots"])
        assert tm["status"] == "ACTIVE"
        assert abs(tm["timeSinceLastHeartbeat"] - time.time() * 1000) < 30_000
        one = shared_rest_cluster.get(f"/taskmanagers/{tm['id']}")
        assert one.status == 200 and len(one.body["allocatedSlots"]) == tm["slotsNumber"] - tm["freeSlots"]


def test_jobs_show_status_restarts_and_routing(shared_rest_cluster: RestCluster) -> None:
    info = shared_rest_cluster.client.job_info(JOB)
    assert shared_rest_cluster.get("/jobs").body == {"jobs": [{"id": JOB, "status": "RUNNING"}]}
    (entry,) = shared_rest_cluster.get("/jobs/overview").body["jobs"]
    assert entry["jid"] == JOB and entry["state"] == "RUNNING"
    assert entry["restarts"] == info.restarts == 0
    assert entry["routing-version"] == info.routing_version > 0
    assert entry["tasks"] == {
        "total": SUBTASKS,
        "created": 0,
        "running": SUBTASKS,
        "finished": 0,
        "canceled": 0,
        "failed": 0,
    }
    assert entry["latest-checkpoint-id"] == info.latest_checkpoint_id > 0

    job = shared_rest_cluster.get(f"/jobs/{JOB}").body
    assert [(v["id"], v["parallelism"]) for v in job["vertices"]] == [
        (op.operator_id, op.parallelism) for op in OPERATORS
    ]
    assert job["maxParallelism"] == 128
    routes = job["routing"]["routes"]
    assert job["routing"]["version"] == info.routing_version
    assert len(routes) == SUBTASKS
    # The routes of one operator cover every key group exactly once.
    for op in OPERATORS:
        ranges = sorted(r["keyGroups"] for r in routes if r["operatorId"] == op.operator_id)
        assert ranges[0][0] == 0 and ranges[-1][1] == 127
        assert all(a[1] + 1 == b[0] for a, b in itertools.pairwise(ranges))


def test_checkpoints_document_counts_history_and_latest(shared_rest_cluster: RestCluster) -> None:
    listed = {c.checkpoint_id: c for c in shared_rest_cluster.client.list_checkpoints(JOB).checkpoints}
    doc = shared_rest_cluster.get(f"/jobs/{JOB}/checkpoints").body
    assert doc["counts"] == {"restored": 0, "total": 3, "in_progress": 0, "completed": 2, "failed": 1}
    history = doc["history"]
    assert [c["id"] for c in history] == sorted(listed, reverse=True)
    failed, second, first = history
    assert failed["status"] == "FAILED" and failed["is_savepoint"] and failed["checkpoint_type"] == "SAVEPOINT"
    assert failed["failure_reason"] and failed["failure_message"]
    assert listed[failed["id"]].failure_reason.startswith(failed["failure_reason"])
    for c in (first, second):
        assert c["status"] == "COMPLETED" and c["className"] == ".CompletedCheckpointStatistics"
        info = listed[c["id"]]
        assert c["state_size"] == info.full_size > 0
        assert c["checkpointed_size"] == info.incremental_size > 0
        assert c["end_to_end_duration"] == info.duration_ms
        assert c["external_path"] == info.path
        assert c["num_acknowledged_subtasks"] == c["num_subtasks"] == SUBTASKS
        assert c["trigger_timestamp"] <= c["latest_ack_timestamp"]
    assert second["state_size"] > first["state_size"]  # twice the keys
    assert doc["latest"]["completed"]["id"] == second["id"]
    assert doc["latest"]["failed"]["id"] == failed["id"]
    assert doc["summary"]["state_size"]["max"] == second["state_size"]
    assert doc["summary"]["state_size"]["min"] == first["state_size"]


def test_checkpoint_details_show_every_subtasks_ack_with_sync_and_async_times(shared_rest_cluster: RestCluster) -> None:
    latest = shared_rest_cluster.get(f"/jobs/{JOB}/checkpoints").body["latest"]["completed"]
    details = shared_rest_cluster.get(f"/jobs/{JOB}/checkpoints/details/{latest['id']}").body
    assert sorted(details["tasks"]) == sorted(op.operator_id for op in OPERATORS)
    assert sum(t["state_size"] for t in details["tasks"].values()) == latest["state_size"]
    # The details carry every subtask's ack too, equal to the per-operator endpoint's.
    for op in OPERATORS:
        same = shared_rest_cluster.get(f"/jobs/{JOB}/checkpoints/details/{latest['id']}/subtasks/{op.operator_id}").body
        assert details["tasks"][op.operator_id]["subtasks"] == same["subtasks"]
    for op in OPERATORS:
        sub = shared_rest_cluster.get(f"/jobs/{JOB}/checkpoints/details/{latest['id']}/subtasks/{op.operator_id}").body
        assert [s["index"] for s in sub["subtasks"]] == list(range(op.parallelism))
        for s in sub["subtasks"]:
            assert s["status"] == "completed"
            assert s["state_size"] > 0
            assert s["checkpoint"]["sync"] >= 0 and s["checkpoint"]["async"] >= 0
            assert latest["trigger_timestamp"] <= s["ack_timestamp"] <= latest["latest_ack_timestamp"]
        # The async part uploads files: across the subtasks it took measurable time.
        assert sum(s["checkpoint"]["async"] + s["checkpoint"]["sync"] for s in sub["subtasks"]) >= 0
        assert sub["summary"]["checkpoint_duration"]["async"]["max"] == max(
            s["checkpoint"]["async"] for s in sub["subtasks"]
        )


def test_checkpoint_config_reads_the_jobs_settings(rest_cluster: RestCluster) -> None:
    rest_cluster.client.submit_job(
        "tuned",
        [OperatorSpec("sessions", 1, OPERATORS[0].states)],
        max_parallelism=64,
        config={"execution.checkpointing.interval": "7 s", "execution.checkpointing.incremental": "true"},
    )
    tuned = rest_cluster.get("/jobs/tuned/checkpoints/config").body
    assert tuned["interval"] == 7000 and tuned["incremental"] is True and tuned["mode"] == "exactly_once"
    assert tuned["state_backend"] == "EmbeddedRocksDBStateBackend"
    default = rest_cluster.get(f"/jobs/{JOB}/checkpoints/config").body
    assert default["interval"] == 0x7FFFFFFFFFFFFFFF  # periodic checkpoints off, as Flink reports it
    assert default["checkpoints_dir"].endswith(f"/{JOB}")
    assert (default["claim_mode"], default["restore_path"]) == ("NO_CLAIM", None)  # submitted without a restore


def test_config_documents_read_the_configuration_with_secrets_redacted(inprocess_cluster: object) -> None:
    from tests.integration.rest.conftest import start_rest_cluster

    rc = start_rest_cluster(
        inprocess_cluster,  # type: ignore[arg-type]
        jm={"s3.secret-key": "very-secret-value", "web.refresh-interval": "1500 ms"},
    )
    assert rc.get("/config").body["refresh-interval"] == 1500
    assert rc.get("/overview").body["taskmanagers"] == 2
    entries = {e["key"]: e["value"] for e in rc.get("/jobmanager/config").body}
    assert entries["rest.port"] == "0"
    assert entries["s3.secret-key"] != "very-secret-value" and "very-secret-value" not in str(entries)


def test_unknown_job_checkpoint_operator_and_path_are_404_naming_the_fix(shared_rest_cluster: RestCluster) -> None:
    cases = {
        "/jobs/nope": "list them at /jobs",
        "/jobs/nope/checkpoints": "known jobs: orders",
        f"/jobs/{JOB}/checkpoints/details/999": f"/jobs/{JOB}/checkpoints",
        f"/jobs/{JOB}/checkpoints/details/1/subtasks/nope": "its operators: sessions, totals",
        "/taskmanagers/tm-9": "registered: tm-0, tm-1",
        "/no/such/thing": "/openapi.json",
    }
    for path, hint in cases.items():
        answer = shared_rest_cluster.get(path)
        assert answer.status == 404, path
        assert answer.headers["Content-Type"] == "application/json"
        (message,) = answer.body["errors"]
        assert hint in message, (path, message)


def test_writes_are_405_with_allow(shared_rest_cluster: RestCluster) -> None:
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        answer = shared_rest_cluster.get(f"/jobs/{JOB}", method=method)
        assert answer.status == 405, method
        assert answer.headers["Allow"] == "GET, HEAD"
        assert f"{method} is not allowed" in answer.body["errors"][0]
    assert shared_rest_cluster.get(f"/jobs/{JOB}", method="HEAD").status == 200
    assert (
        shared_rest_cluster.get("/v1/overview").body == shared_rest_cluster.get("/overview").body
    )  # Flink's /v1 prefix


def test_a_stalled_client_does_not_stall_checkpoints_or_other_requests(rest_cluster: RestCluster) -> None:
    """Clients that connect and never finish their request, and one that never reads its answer,
    hold only their own threads: checkpoints complete and other requests are answered meanwhile."""
    port = rest_cluster.cluster.jobmanager.rest_port
    assert port is not None
    stalled = []
    for i in range(8):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"GET /jobs/orders/checkpoints HTTP/1.1\r\nHost: x\r\n" if i % 2 else b"GE")
        stalled.append(sock)
    # A reader that asks for a document and never reads it (its socket buffer fills, the send blocks).
    reader = socket.create_connection(("127.0.0.1", port))
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    try:
        # One send: the server answers the first request and may close the connection (HTTP/1.0
        # style) while the rest is unread, which resets it; the point is what the server does.
        reader.sendall(b"GET /jobmanager/config HTTP/1.1\r\nHost: x\r\n\r\n" * 50)
    except (BrokenPipeError, ConnectionResetError):
        pass
    try:
        done = threading.Event()
        ids: list[int] = []

        def checkpoints() -> None:
            for tag in range(3, 6):
                write_keys(rest_cluster.client, JOB, 100, tag)
                ids.append(complete_checkpoint(rest_cluster.client))
            done.set()

        worker = threading.Thread(target=checkpoints)
        worker.start()
        while not done.wait(0.2):
            assert rest_cluster.get("/overview", timeout=30).status == 200
        worker.join()
        assert len(ids) == 3
        history = rest_cluster.get(f"/jobs/{JOB}/checkpoints").body["history"]
        assert {c["id"] for c in history if c["status"] == "COMPLETED"} >= set(ids)
    finally:
        for sock in (*stalled, reader):
            sock.close()
    assert rest_cluster.get("/jobs").body == {"jobs": [{"id": JOB, "status": "RUNNING"}]}


def test_a_restore_shows_in_counts_latest_and_the_jobs_routing(rest_cluster: RestCluster) -> None:
    before = rest_cluster.get(f"/jobs/{JOB}").body
    latest = rest_cluster.get(f"/jobs/{JOB}/checkpoints").body["latest"]["completed"]
    rest_cluster.client.restore_job(JOB, latest["external_path"])
    doc = rest_cluster.get(f"/jobs/{JOB}/checkpoints").body
    assert doc["counts"]["restored"] == 1
    assert doc["latest"]["restored"]["id"] == latest["id"]
    assert doc["latest"]["restored"]["restore_timestamp"] >= latest["trigger_timestamp"]
    after = rest_cluster.get(f"/jobs/{JOB}").body
    assert after["state"] == "RUNNING"
    assert after["routing-version"] > before["routing-version"]  # redeployed under a new routing version
    assert after["routing"]["version"] == after["routing-version"]
    # Flink's default claim mode: the restored checkpoint stays the user's.
    config = rest_cluster.get(f"/jobs/{JOB}/checkpoints/config").body
    assert (config["claim_mode"], config["restore_path"]) == ("NO_CLAIM", latest["external_path"])


def test_the_history_keeps_web_checkpoints_history_entries(rest_cluster: RestCluster) -> None:
    short = [OperatorSpec("sessions", 1, OPERATORS[0].states)]
    rest_cluster.client.submit_job("short", short, max_parallelism=16, config={"web.checkpoints.history": "2"})
    ids = [complete_checkpoint(rest_cluster.client, "short") for _ in range(3)]
    doc = rest_cluster.get("/jobs/short/checkpoints").body
    assert [c["id"] for c in doc["history"]] == ids[:0:-1]  # the two newest
    assert doc["counts"]["completed"] == 3  # counts cover the whole life, not just the history
    gone = rest_cluster.get(f"/jobs/short/checkpoints/details/{ids[0]}")
    assert gone.status == 404 and f"it holds {ids[2]}, {ids[1]}" in gone.body["errors"][0]


def test_start_end_time_and_duration_follow_the_jobs_life(rest_cluster: RestCluster) -> None:
    before = int(time.time() * 1000)
    rest_cluster.client.submit_job(OTHER_JOB, OPERATORS[:1], max_parallelism=MAX_P)
    running = rest_cluster.get(f"/jobs/{OTHER_JOB}").body
    assert before <= running["start-time"] <= running["now"] and running["end-time"] == -1
    assert 0 <= running["duration"] <= running["now"] - running["start-time"]
    rest_cluster.client.cancel_job(OTHER_JOB)
    ended = rest_cluster.get(f"/jobs/{OTHER_JOB}").body
    assert ended["state"] == "CANCELED" and ended["start-time"] == running["start-time"]
    assert ended["start-time"] <= ended["end-time"] <= ended["now"]
    assert ended["duration"] == ended["end-time"] - ended["start-time"]
    # The first job started before the second and has not ended.
    (first,) = [j for j in rest_cluster.get("/jobs/overview").body["jobs"] if j["jid"] == JOB]
    assert 0 < first["start-time"] <= running["start-time"] and first["end-time"] == -1


def test_taskmanagers_list_their_slot_processes(inprocess_cluster: Callable[..., InProcessCluster]) -> None:
    """``taskmanager.slot-processes: 2`` on one of two TaskManagers: ``/taskmanagers`` lists each slot process
    (index, address, pid, slots) as the TaskManager runs it and as ``statectl cluster`` (the gRPC overview)
    shows it, an empty list for the TaskManager that serves its slots itself, and a replaced process's new
    pid and address once the TaskManager registered them."""
    cluster = inprocess_cluster(taskmanagers=1, slots=4, jm={"rest.port": 0})
    tm = cluster.add_taskmanager(**{"taskmanager.slot-processes": 2})
    client = cluster.client()
    client.wait_for_taskmanagers(2)
    rest = RestCluster(cluster, client, f"http://127.0.0.1:{cluster.jobmanager.rest_port}")
    assert tm.slot_processes is not None

    def expected() -> list[dict[str, Any]]:
        assert tm.slot_processes is not None
        addresses, pids = tm.slot_processes.slot_addresses(), tm.slot_processes.pids()
        return [{"index": i, "address": addresses[i], "pid": pids[i], "slots": [i, i + 2]} for i in range(2)]

    def listed() -> dict[str, list[dict[str, Any]]]:
        answer = rest.get("/taskmanagers")
        assert answer.status == 200
        check("/taskmanagers", 200, answer.body)
        return {t["id"]: t["slotProcesses"] for t in answer.body["taskmanagers"]}

    before = expected()
    assert len({p["pid"] for p in before}) == 2 and len({p["address"] for p in before}) == 2
    assert listed() == {"tm-0": [], "tm-1": before}
    grpc_view = {t.taskmanager_id: t for t in client.cluster().taskmanagers}
    assert [(p.index, p.address, p.pid) for p in grpc_view["tm-1"].slot_processes] == [
        (p["index"], p["address"], p["pid"]) for p in before
    ]
    one = rest.get("/taskmanagers/tm-1")
    check("/taskmanagers/{taskmanagerid}", 200, one.body)
    assert one.body["slotProcesses"] == before

    os.kill(before[1]["pid"], signal.SIGKILL)
    # The TaskManager replaces it and registers the new process with its next heartbeat.
    wait_for(
        lambda: (
            tm.slot_processes is not None
            and tm.slot_processes.pids()[1] not in (0, before[1]["pid"])
            and listed()["tm-1"] == expected()
        ),
        60,
        "/taskmanagers showing the replaced slot process",
    )
    after = listed()["tm-1"]
    assert after[0] == before[0] and after[1]["pid"] != before[1]["pid"]
