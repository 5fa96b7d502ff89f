"""The environment the harness gives MindSpore CPU ranks: launch blocking on (see
[Note: MindSpore CPU ranks launch blocking] in ``hyper_parallel/testing/rendezvous.py``),
unless the caller chose otherwise; other backends are left alone."""

from __future__ import annotations

import pytest

from hyper_parallel.testing.rendezvous import LAUNCH_BLOCKING_VAR, launch_plan


def test_mindspore_cpu_ranks_launch_blocking(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LAUNCH_BLOCKING_VAR, raising=False)
    plans = launch_plan("mindspore-cpu", 2, 12345)
    assert [plan.env.get(LAUNCH_BLOCKING_VAR) for plan in plans] == ["1", "1", "1"]


def test_caller_choice_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LAUNCH_BLOCKING_VAR, "0")
    # not in the plan: the child inherits the parent's "0"
    assert all(LAUNCH_BLOCKING_VAR not in plan.env for plan in launch_plan("mindspore-cpu", 2, 12345))


@pytest.mark.parametrize("platform", ["torch-cpu", "mindspore-ascend"])
def test_other_backends_untouched(monkeypatch: pytest.MonkeyPatch, platform: str) -> None:
    monkeypatch.delenv(LAUNCH_BLOCKING_VAR, raising=False)
    assert all(LAUNCH_BLOCKING_VAR not in plan.env for plan in launch_plan(platform, 2, 12345))
