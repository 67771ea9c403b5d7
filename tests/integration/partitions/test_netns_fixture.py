"""The netns fixture itself: a cut really drops TCP between two hosts (and only between them),
heal restores it, loss drops about the share asked for, and nothing is left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common.rpc.enums import name_of
from tests.fixtures.netns import Host, NetnsSettings, VirtualNetwork, check_requirements, find_iptables

pytestmark = pytest.mark.netns

PROBE = str(Path(__file__).with_name("_probe.py"))
PORT = 7007


def start_echo(net: VirtualNetwork, host: Host) -> subprocess.Popen[str]:
    server = net.popen(host, [sys.executable, PROBE, "tcp-echo", host.ip, str(PORT)], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None and server.stdout.readline().strip() == "ready"
    return server


def reaches(net: VirtualNetwork, client: Host, server: Host, timeout_s: float = 1.0) -> bool:
    """A fresh TCP connection from ``client`` to the echo server on ``server`` gets its echo."""
    out: str = net.run(
        client,
        [sys.executable, PROBE, "tcp-probe", server.ip, str(PORT), str(timeout_s)],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout.strip()
    assert out == "ok" or out.startswith("fail"), out
    return out == "ok"


def test_cut_drops_tcp_between_two_hosts_only_and_heal_restores_it(netns: VirtualNetwork) -> None:
    a, b, c = (netns.add_host(n) for n in ("a", "b", "c"))
    start_echo(netns, a)
    assert reaches(netns, b, a) and reaches(netns, c, a) and reaches(netns, netns.local, a)

    netns.cut(a, b)
    started = time.monotonic()
    assert not reaches(netns, b, a)
    # A drop, not a reset: the connection attempt hangs until the client's timeout.
    assert time.monotonic() - started >= 0.9
    assert reaches(netns, c, a) and reaches(netns, netns.local, a), "a cut must leave other pairs alone"
    assert any("-j DROP" in r for r in netns.rules(a))

    netns.heal(a, b)
    assert reaches(netns, b, a)
    assert netns.rules(a) == [] and netns.rules(b) == []


def test_cut_with_local_keeps_the_root_namespace_untouched(netns: VirtualNetwork) -> None:
    a, b = netns.add_host("a"), netns.add_host("b")
    start_echo(netns, a)
    before = subprocess.run([str(find_iptables()), "-w", "-S"], capture_output=True, text=True).stdout
    netns.cut(netns.local, a)
    assert not reaches(netns, netns.local, a)
    assert reaches(netns, b, a)
    assert subprocess.run([str(find_iptables()), "-w", "-S"], capture_output=True, text=True).stdout == before
    netns.heal_all()
    assert reaches(netns, netns.local, a)


def test_an_established_connection_hangs_during_a_cut_and_resumes_after_heal(netns: VirtualNetwork) -> None:
    import socket

    a = netns.add_host("a")
    start_echo(netns, a)
    conn = socket.create_connection((a.ip, PORT), timeout=2)
    with conn:
        conn.sendall(b"one")
        assert conn.recv(3) == b"one"
        netns.cut(netns.local, a)
        conn.sendall(b"two")
        conn.settimeout(1.0)
        with pytest.raises(socket.timeout):
            conn.recv(3)
        netns.heal_all()
        conn.settimeout(10.0)  # TCP retransmits the segment once the path is back
        assert conn.recv(3) == b"two"


def test_isolate_cuts_a_host_from_everyone(netns: VirtualNetwork) -> None:
    a, b = netns.add_host("a"), netns.add_host("b")
    start_echo(netns, a)
    start_echo(netns, b)
    netns.isolate(a)
    assert not reaches(netns, b, a) and not reaches(netns, netns.local, a) and not reaches(netns, a, b)
    assert reaches(netns, netns.local, b)
    netns.heal(a)
    assert reaches(netns, b, a) and reaches(netns, netns.local, a)

    netns.isolate(netns.local)
    assert not reaches(netns, netns.local, a) and not reaches(netns, netns.local, b)
    assert reaches(netns, a, b), "isolating local leaves the other hosts connected"
    netns.heal_all()
    assert reaches(netns, netns.local, a)


@pytest.mark.parametrize("probability", [0.3])
def test_loss_drops_about_the_share_asked_for(netns: VirtualNetwork, probability: float) -> None:
    a, b = netns.add_host("a"), netns.add_host("b")
    n = 4000
    counter = netns.popen(
        a, [sys.executable, PROBE, "udp-count", a.ip, str(PORT), "1.0"], stdout=subprocess.PIPE, text=True
    )
    assert counter.stdout is not None and counter.stdout.readline().strip() == "ready"
    netns.loss(a, b, probability)
    sent = netns.run(
        b, [sys.executable, PROBE, "udp-send", a.ip, str(PORT), str(n)], capture_output=True, text=True, timeout=60
    )
    assert sent.stdout.strip() == "sent", sent.stderr
    received = int(counter.stdout.readline())
    counter.wait(timeout=10)
    # Binomial: the standard deviation of the share is about 0.7 %; 4 % is far outside chance.
    share_lost = 1 - received / n
    assert abs(share_lost - probability) < 0.04, f"{share_lost:.3f} of {n} datagrams lost, {probability} asked for"
    netns.heal(a, b)
    start_echo(netns, a)
    assert all(reaches(netns, b, a) for _ in range(5))


def test_teardown_leaves_nothing_and_start_removes_dead_runs_leftovers() -> None:
    ip, _ = check_requirements()
    settings = NetnsSettings()
    # A dead run's leftovers: names with the pid of a process that has exited.
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = gone.pid
    dead_ns, dead_bridge = f"{settings.prefix}-{dead}-x", f"{settings.prefix}{dead}-br"
    subprocess.run([ip, "netns", "add", dead_ns], check=True)
    subprocess.run([ip, "link", "add", dead_bridge, "type", "bridge"], check=True)
    try:
        net = VirtualNetwork(settings)
        with net:
            a, b = net.add_host("a"), net.add_host("b")
            net.popen(a, ["sleep", "300"])  # a process still inside a namespace at teardown
            net.cut(a, b)
            net.loss(a, net.local, 0.1)
            mine = net.leftovers()
            assert len(mine) == 5, mine  # 2 namespaces, 2 veths, the bridge
            namespaces = subprocess.run([ip, "netns", "list"], capture_output=True, text=True).stdout
            assert dead_ns not in namespaces, "a dead run's namespace survived the start of a new run"
            links = subprocess.run([ip, "-o", "link", "show"], capture_output=True, text=True).stdout
            assert dead_bridge not in links, "a dead run's bridge survived the start of a new run"
        assert net.leftovers() == []
        namespaces = subprocess.run([ip, "netns", "list"], capture_output=True, text=True).stdout
        links = subprocess.run([ip, "-o", "link", "show"], capture_output=True, text=True).stdout
        tag = f"{settings.prefix}-{os.getpid()}-"
        assert tag not in namespaces and f"{settings.prefix}{os.getpid()}-" not in links
        assert (
            net.subnet.network_address.exploded
            not in subprocess.run([ip, "-4", "route"], capture_output=True, text=True).stdout
        )
    finally:
        subprocess.run([ip, "netns", "del", dead_ns], capture_output=True)
        subprocess.run([ip, "link", "del", dead_bridge], capture_output=True)


def test_minicluster_daemons_run_in_their_hosts_and_pause_like_a_stalled_host(
    netns: VirtualNetwork, tmp_path: Path
) -> None:
    from keyedstate.common.client import ClientSettings, StateClient
    from tests.fixtures.waiting import wait_for

    jm, tm0, tm1 = (netns.add_host(n) for n in ("jm", "tm0", "tm1"))
    cluster = netns.minicluster(
        tmp_path,
        jm_host=jm,
        tm_hosts=[tm0, tm1],
        slots=1,
        config={"heartbeat.interval": "200 ms", "heartbeat.timeout": "2 s"},
    )
    assert cluster.jobmanager_address == f"{jm.ip}:{cluster.jobmanager_port}"
    for daemon, host in ((cluster.jobmanager, jm), (cluster.taskmanagers[0], tm0), (cluster.taskmanagers[1], tm1)):
        assert daemon is not None and daemon.process is not None
        identified = subprocess.run(
            ["ip", "netns", "identify", str(daemon.process.pid)], capture_output=True, text=True
        )
        assert identified.stdout.strip() == host.netns, f"{daemon.name} runs in {identified.stdout!r}, not {host.netns}"
        assert daemon.address.startswith(f"{host.ip}:"), f"{daemon.name} serves on {daemon.address}"

    with StateClient(cluster.jobmanager_address, ClientSettings(timeout_s=5, max_attempts=2)) as client:

        def status(tm_id: str) -> str:
            """ACTIVE, or "gone" once the JobManager dropped it from the overview (a lost TaskManager)."""
            return next(
                (
                    name_of(jm_pb.TaskManagerStatus, t.status)
                    for t in client.cluster().taskmanagers
                    if t.taskmanager_id == tm_id
                ),
                "gone",
            )

        registered = {t.taskmanager_id: t.address.split(":")[0] for t in client.cluster().taskmanagers}
        assert registered == {"tm-0": tm0.ip, "tm-1": tm1.ip}
        # A paused TaskManager misses its heartbeats like a hung host; resumed, it registers again.
        with cluster.taskmanagers[1].paused():
            wait_for(lambda: status("tm-1") != "ACTIVE", 15, "the paused TaskManager to be declared lost")
        wait_for(lambda: status("tm-1") == "ACTIVE", 15, "the resumed TaskManager to register again")
        assert status("tm-0") == "ACTIVE"
