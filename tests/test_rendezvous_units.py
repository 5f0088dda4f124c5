"""The rendezvous wrapper's flip of ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` (torch's uncached
path while ``next_rendezvous`` runs) when several handlers overlap in one process."""

from __future__ import annotations

import os
import threading

import pytest

from trainguard.runtime import rendezvous

KEY = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


@pytest.mark.parametrize("user", [None, "0", "1"])
def test_overlapping_rounds_restore_the_users_value(
    monkeypatch: pytest.MonkeyPatch, user: str | None
) -> None:
    if user is None:
        monkeypatch.delenv(KEY, raising=False)
    else:
        monkeypatch.setenv(KEY, user)
    a_in, b_in, a_may_leave = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def a() -> None:
        with rendezvous._uncached_store_path():
            a_in.set()
            a_may_leave.wait(10)
        seen["a_left"] = os.environ.get(KEY)

    def b() -> None:
        a_in.wait(10)
        with rendezvous._uncached_store_path():
            b_in.set()
            seen["inside"] = os.environ.get(KEY)
            seen["agent_store"] = rendezvous._user_uses_agent_store()
            a_may_leave.set()  # a leaves first: b is still inside
            while "a_left" not in seen:
                threading.Event().wait(0.01)
            seen["after_a"] = os.environ.get(KEY)

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen["inside"] == "1" and seen["after_a"] == "1"  # torch's uncached path for b
    assert seen["agent_store"] is (user != "1")  # what torch tells the workers: the user's
    assert os.environ.get(KEY) == user  # both out: the user's value, not a leftover "1"
    assert rendezvous._user_uses_agent_store() is None


def test_rendezvous_event_names_without_the_stack_are_torchs() -> None:
    """torch names a rendezvous event after the function that called ``_record``
    (``get_method_name(depth=2)`` over ``inspect.stack()``); trainguard's replacement, which
    every agent installs, names the same function."""
    import inspect

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    from trainguard.runtime import _torch

    def torchs(depth: int = 2) -> str:  # torch 2.13's get_method_name, as written there
        if len(inspect.stack()) > depth:
            return inspect.stack()[depth].function
        return "no_method_name"

    def _record(name_of) -> str:  # noqa: ANN001 - as torch's handler._record calls it
        return name_of()

    def next_rendezvous(name_of) -> str:  # noqa: ANN001
        return _record(name_of)

    _torch.cheap_rendezvous_event_names()
    assert dr.get_method_name.__module__ == "trainguard.runtime._torch"  # installed
    assert next_rendezvous(dr.get_method_name) == next_rendezvous(torchs) == "next_rendezvous"
