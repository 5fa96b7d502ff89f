"""Harness pieces that need no rank process."""

from __future__ import annotations

import pickle
import socket

import pytest

from hyper_parallel.platform import requested_platform
from hyper_parallel.testing import PoolCache, RankError, RankTimeout, WorkerPool, free_port, selected_platform
from hyper_parallel.platform.launch import is_address_in_use, port_in_use
from hyper_parallel.testing.rendezvous import launch_plan


def test_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_port_in_use_sees_a_listener() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        assert port_in_use(listener.getsockname()[1])
    assert not port_in_use(free_port())


def test_address_in_use_is_recognised() -> None:
    assert is_address_in_use("RuntimeError: [Errno 98] Address already in use")
    assert not is_address_in_use("ValueError: bad shape")


def test_rank_errors_survive_pickling() -> None:
    error = pickle.loads(pickle.dumps(RankError("rank 1 raised", rank=1, remote_traceback="tb", exit_code=None)))
    assert (str(error), error.rank, error.remote_traceback) == ("rank 1 raised", 1, "tb")
    timeout = pickle.loads(pickle.dumps(RankTimeout("late", ranks=(2, 3), timeout_s=5.0, stacks={2: "s"})))
    assert isinstance(timeout, RankTimeout) and isinstance(timeout, RankError)
    assert (timeout.rank, timeout.ranks, timeout.timeout_s, timeout.stacks) == (2, (2, 3), 5.0, {2: "s"})


@pytest.mark.parametrize(("platform", "roles"), [
    ("torch-cpu", ["worker", "worker"]),
    ("mindspore-cpu", ["worker", "worker", "scheduler"]),
])
def test_launch_plan_per_backend(platform: str, roles: list[str]) -> None:
    port = free_port()
    plans = launch_plan(platform, 2, port)
    assert [plan.role.value for plan in plans] == roles
    assert [plan.rank for plan in plans if plan.role.value == "worker"] == [0, 1]
    # every process of the world meets on the one port
    assert {plan.env.get("MASTER_PORT") or plan.env.get("MS_SCHED_PORT") for plan in plans} == {str(port)}


def test_bad_arguments_fail_before_any_process_starts() -> None:
    with pytest.raises(ValueError, match="world_size=0 must be >= 1"):
        WorkerPool("torch-cpu", 0)
    with pytest.raises(ValueError, match="platform='tensorflow' is not a backend"):
        WorkerPool("tensorflow", 2)
    with pytest.raises(ValueError, match="start_timeout_s=0 must be > 0"):
        WorkerPool("torch-cpu", 2, start_timeout_s=0)
    with pytest.raises(ValueError, match="max_pools=0"):
        PoolCache(max_pools=0)


def test_selected_platform_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYPER_PARALLEL_PLATFORM", "mindspore-cpu")
    assert selected_platform() == "mindspore-cpu"
    monkeypatch.setenv("HYPER_PARALLEL_PLATFORM", "torch")
    assert selected_platform() == "torch-cpu"
    # unset: the CPU backend of the framework the one selection rule picks (DESIGN's order)
    monkeypatch.delenv("HYPER_PARALLEL_PLATFORM")
    assert selected_platform() == f"{requested_platform()}-cpu"
