"""Tiny network peers run inside a host's namespace by the netns fixture's own tests.

``python _probe.py tcp-echo IP PORT``         echo server; prints ``ready`` once listening
``python _probe.py tcp-probe IP PORT TIMEOUT`` connect, send, read the echo; prints ``ok`` or ``fail <error>``
``python _probe.py udp-count IP PORT SECONDS`` counts datagrams until SECONDS of silence after the first; prints ``ready``, then the count
``python _probe.py udp-send IP PORT N``        sends N datagrams, paced so no receive buffer overflows

A script rather than a module import, so it runs under ``ip netns exec`` with any working directory.
"""

from __future__ import annotations

import socket
import sys
import threading
import time


def tcp_echo(ip: str, port: int) -> None:
    server = socket.create_server((ip, port))
    print("ready", flush=True)

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    while True:
        conn, _ = server.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def tcp_probe(ip: str, port: int, timeout: float) -> None:
    try:
        with socket.create_connection((ip, port), timeout=timeout) as conn:
            conn.sendall(b"ping")
            reply = conn.recv(4)
        print("ok" if reply == b"ping" else f"fail reply {reply!r}", flush=True)
    except OSError as exc:
        print(f"fail {type(exc).__name__}: {exc}", flush=True)


def udp_count(ip: str, port: int, quiet_s: float) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind((ip, port))
    print("ready", flush=True)
    count = 0
    sock.settimeout(30.0)  # until the first datagram
    try:
        while True:
            sock.recv(2048)
            count += 1
            sock.settimeout(quiet_s)
    except TimeoutError:
        pass
    print(count, flush=True)


def udp_send(ip: str, port: int, n: int) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for i in range(n):
        sock.sendto(b"x" * 64, (ip, port))
        if i % 50 == 49:
            time.sleep(0.002)
    print("sent", flush=True)


if __name__ == "__main__":
    command, host, port_text, *rest = sys.argv[1:]
    port = int(port_text)
    if command == "tcp-echo":
        tcp_echo(host, port)
    elif command == "tcp-probe":
        tcp_probe(host, port, float(rest[0]))
    elif command == "udp-count":
        udp_count(host, port, float(rest[0]))
    elif command == "udp-send":
        udp_send(host, port, int(rest[0]))
    else:
        sys.exit(f"unknown command {command!r}")
