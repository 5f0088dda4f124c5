"""What an agent says when its call to the c10d rendezvous store fails after a round: the agent
that hosts the store (a TCPStore server in its own process) names itself and the store's own
error, instead of reporting its own node as lost; any other agent reports the store's host as
gone, with the store's error."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend

from trainguard.runtime.launcher import c10d_store_failure, listens_here
from trainguard.runtime.spares import C10D_STORE_LOST
from trainguard.testing.ports import free_port


def _connections_to(port: int) -> list[int]:
    """This process's sockets connected to ``port`` (their descriptors)."""
    fds = []
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            with socket.socket(fileno=os.dup(fd)) as s:
                if s.getpeername()[1] == port:
                    fds.append(fd)
        except OSError:
            continue
    return fds


def test_the_store_host_names_its_own_broken_connection_and_the_stores_error() -> None:
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    params = RendezvousParameters(
        backend="c10d", endpoint=endpoint, run_id="diag", min_nodes=1, max_nodes=1
    )
    backend, store = create_backend(params)  # this process hosts it, as the first agent does
    assert backend.get_state() is None and listens_here(port) is True
    (fd,) = _connections_to(port)  # this process's own client connection
    with socket.socket(fileno=os.dup(fd)) as s:
        s.shutdown(socket.SHUT_RDWR)
    with pytest.raises(RendezvousConnectionError) as e:
        backend.get_state()
    line = c10d_store_failure(endpoint, store, e.value)
    assert line.startswith("trainguard run: this agent hosts the c10d rendezvous store"), line
    assert f"port {port}" in line and "DistNetworkError: " in line, line
    assert "was lost" not in line


def test_a_store_in_another_process_is_a_lost_host_with_the_stores_error() -> None:
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import socket,sys; s=socket.create_server(('127.0.0.1',{port}));"
            "print(1, flush=True); sys.stdin.read()",
        ],  # fmt: skip
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "1"
        assert listens_here(port) is False  # it listens, not in this process

        class Store:  # the client's port as torch's TCPStore has it
            pass

        store = Store()
        store.port = port  # type: ignore[attr-defined]
        try:
            raise RendezvousConnectionError("The connection to the C10d store has failed.") from (
                RuntimeError("Connection reset by peer\nException raised from recvBytes")
            )
        except RendezvousConnectionError as err:
            line = c10d_store_failure(f"127.0.0.1:{port}", store, err)
    finally:
        server.kill()
        server.wait(timeout=30)
    head, tail = line.split("\n")
    assert head == C10D_STORE_LOST.format(endpoint=f"127.0.0.1:{port}")
    assert tail == "  the store call failed: RuntimeError: Connection reset by peer"


def test_a_port_nothing_listens_on_is_not_here() -> None:
    assert listens_here(free_port()) is False
    with socket.create_server(("127.0.0.1", 0)) as s:
        assert listens_here(s.getsockname()[1]) is True
