"""The round's worker-store port stays bound from the moment torch picks it until the store
listens on it: no other process can take it in between (a restart's store once failed with
EADDRINUSE under load)."""

from __future__ import annotations

import errno
import socket

import pytest
from torch.distributed import HashStore, TCPStore
from torch.distributed.elastic.rendezvous import RendezvousStoreInfo
from torch.distributed.elastic.rendezvous import api as rdzv_api

from trainguard.runtime._torch import reserved_bootstrap_port, take_reserved_port


def _bind(port: int) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_the_picked_port_is_held_until_the_store_takes_it() -> None:
    torch_pick = rdzv_api.get_free_port
    with reserved_bootstrap_port():
        info = RendezvousStoreInfo.build(0, HashStore(), local_addr="localhost")
    assert rdzv_api.get_free_port is torch_pick  # restored outside a round
    with pytest.raises(OSError) as e:
        _bind(info.master_port)  # what another process would meet
    assert e.value.errno == errno.EADDRINUSE
    sock = take_reserved_port(info.master_port)
    assert sock is not None and take_reserved_port(info.master_port) is None
    server = TCPStore(
        "localhost", info.master_port, is_master=True, multi_tenant=True,
        wait_for_workers=False, master_listen_fd=sock.detach(),
    )  # fmt: skip
    client = TCPStore("localhost", info.master_port, is_master=False)
    client.set("k", "v")
    assert server.get("k") == b"v"
    del client, server


def test_a_reservation_for_another_port_is_released() -> None:
    with reserved_bootstrap_port():
        port = RendezvousStoreInfo.build(0, HashStore(), local_addr="localhost").master_port
    assert take_reserved_port(port + 1 if port < 65535 else port - 1) is None
    _bind(port)  # closed: free again


def test_ranks_other_than_0_reserve_nothing() -> None:
    store = HashStore()
    with reserved_bootstrap_port():
        port = RendezvousStoreInfo.build(0, store, local_addr="localhost").master_port
        take_reserved_port(port).close()  # type: ignore[union-attr]
        assert RendezvousStoreInfo.build(1, store, local_addr="x").master_port == port
    assert take_reserved_port(port) is None
