"""The tests' port allocator never hands out an ephemeral port or the same port twice."""

from __future__ import annotations

import socket

from trainguard.testing.ports import _ephemeral_low, free_port


def test_ports_are_outside_the_ephemeral_range_and_distinct() -> None:
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(p < _ephemeral_low() for p in ports)


def test_a_port_in_use_is_skipped() -> None:
    with socket.socket() as held:
        port = free_port()
        held.bind(("127.0.0.1", port + 1))
        assert free_port() != port + 1


def test_a_block_of_ports_is_taken_whole() -> None:
    """A role's replicas bind ``port + i``: a block's ports are never handed out again."""
    first = free_port(3)
    after = [free_port() for _ in range(20)]
    assert not {first, first + 1, first + 2} & set(after)
