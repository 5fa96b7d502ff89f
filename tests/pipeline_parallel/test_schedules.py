"""Pipeline schedules as data: notation, CSV, lowering, the validator and the simulator.
Pure Python (no ranks): the same on every backend."""

from __future__ import annotations

from fractions import Fraction

import pytest

from hyper_parallel.core.pipeline_parallel.schedules import (Action, ActionType, ScheduleError, add_communication,
                                                             from_csv, gpipe, interleaved_1f1b, one_f_one_b,
                                                             simulate, to_csv, validate)

A = ActionType


def test_action_notation_round_trip() -> None:
    for text in ("2F0", "0B13", "1I3", "1W3", "1SEND_F3", "3RECV_B0"):
        assert str(Action.parse(text)) == text
    assert Action.parse("2F0") == Action(2, A.F, 0)
    with pytest.raises(ValueError, match="'2X0' is not <stage>"):
        Action.parse("2X0")


def test_csv_round_trip() -> None:
    schedule = add_communication(one_f_one_b(4, 8), 4)
    assert from_csv(to_csv(schedule)) == schedule
    assert to_csv(gpipe(2, 2)) == "0,0F0,0F1,0B1,0B0\n1,1F0,1F1,1B1,1B0\n"


@pytest.mark.parametrize("num_ranks", [2, 4])
@pytest.mark.parametrize("n_microbatches", [4, 8])
@pytest.mark.parametrize("make", [gpipe, one_f_one_b], ids=["gpipe", "1f1b"])
def test_generated_schedules_validate(make, num_ranks: int, n_microbatches: int) -> None:
    schedule = make(num_ranks, n_microbatches)
    validate(schedule, num_ranks, n_microbatches)
    validate(add_communication(schedule, num_ranks), num_ranks, n_microbatches)


@pytest.mark.parametrize("num_ranks", [2, 4])
@pytest.mark.parametrize("n_microbatches", [4, 8])
def test_interleaved_validates(num_ranks: int, n_microbatches: int) -> None:
    stages = 2 * num_ranks
    schedule = interleaved_1f1b(num_ranks, 2, n_microbatches)
    validate(schedule, stages, n_microbatches)
    validate(add_communication(schedule, stages), stages, n_microbatches)


def _drop(schedule, rank, text):
    return {r: [a for a in actions if not (r == rank and str(a) == text)] for r, actions in schedule.items()}


def test_validator_rejects_broken_schedules() -> None:
    good = add_communication(one_f_one_b(4, 4), 4)
    with pytest.raises(ScheduleError, match="0SEND_F1 has no matching 1RECV_F1 on rank 1"):
        validate(_drop(good, 1, "1RECV_F1"), 4, 4)
    with pytest.raises(ScheduleError, match="2B3 is missing"):
        validate(_drop(good, 2, "2B3"), 4, 4)
    duplicated = {r: list(a) for r, a in good.items()}
    duplicated[0].append(Action(0, A.F, 0))
    with pytest.raises(ScheduleError, match="0F0 appears 2 times"):
        validate(duplicated, 4, 4)
    misplaced = {r: list(a) for r, a in good.items()}
    misplaced[1].append(Action(3, A.W, 0))
    with pytest.raises(ScheduleError, match="belongs to rank 3"):
        validate(misplaced, 4, 4)
    # Rank 1 waits for microbatch 1's gradient before sending microbatch 1 forward: stage
    # 2 can never run 2F1, so the gradient never comes and the pipeline stops.
    swapped = {r: list(a) for r, a in good.items()}
    recv_b1 = Action(1, A.RECV_B, 1)
    swapped[1].remove(recv_b1)
    swapped[1].insert(swapped[1].index(Action(1, A.SEND_F, 1)), recv_b1)
    with pytest.raises(ScheduleError, match=r"deadlocks.*1: '1RECV_B1'"):
        validate(swapped, 4, 4)


@pytest.mark.parametrize("make", [gpipe, one_f_one_b], ids=["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (3, 5)])
@pytest.mark.parametrize("costs", [{A.F: 1.0, A.B: 2.0}, {A.F: 1.0, A.B: 1.0}], ids=["b2f", "b1f"])
def test_bubble_matches_the_closed_form(make, p: int, m: int, costs) -> None:
    for schedule in (make(p, m), add_communication(make(p, m), p)):
        result = simulate(schedule, p, costs=costs)
        assert Fraction(result.bubble_fraction).limit_denominator(1000) == Fraction(p - 1, m + p - 1)
        assert result.step_time == pytest.approx((m + p - 1) * (costs[A.F] + costs[A.B]))


def test_memory_prediction() -> None:
    assert simulate(gpipe(4, 8), 4).peak_activations == {0: 8, 1: 8, 2: 8, 3: 8}
    assert simulate(one_f_one_b(4, 8), 4).peak_activations == {0: 4, 1: 3, 2: 2, 3: 1}
    sized = simulate(one_f_one_b(2, 4), 2, activation_size=lambda a: 10.0 * (a.stage_index + 1))
    assert sized.peak_activations == {0: 20.0, 1: 20.0}


def test_interleaving_and_latency() -> None:
    p, m = 4, 8
    plain = simulate(one_f_one_b(p, m), p).bubble_fraction
    interleaved = simulate(add_communication(interleaved_1f1b(p, 2, m), 2 * p), 2 * p,
                           costs={A.F: 0.5, A.B: 1.0}).bubble_fraction
    assert interleaved < plain  # virtual stages shrink the bubble
    assert interleaved == pytest.approx((p - 1) / (2 * m + p - 1))
    lowered = add_communication(one_f_one_b(p, m), p)
    assert simulate(lowered, p, comm_latency=0.25).step_time > simulate(lowered, p).step_time


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="multiple of num_ranks=4"):
        interleaved_1f1b(4, 2, 6)
    with pytest.raises(ValueError, match="must both be >= 1"):
        gpipe(0, 4)


@pytest.mark.parametrize("num_ranks,n_microbatches", [(2, 4), (4, 8)])
def test_overlap_b_f_actions(num_ranks: int, n_microbatches: int) -> None:
    text = "(2B1;3F4)OVERLAP_B_F"
    action = Action.parse(text)
    assert str(action) == text and action.sub_actions == (Action(2, A.B, 1), Action(3, A.F, 4))
    with pytest.raises(ValueError, match="needs a B and an F"):
        Action.overlap(Action(2, A.F, 1), Action(3, A.F, 4))
    paired = interleaved_1f1b(num_ranks, 2, n_microbatches, overlap_b_f=True)
    assert any(a.type is A.OVERLAP_B_F for a in paired[0])
    lowered = add_communication(paired, 2 * num_ranks)
    assert from_csv(to_csv(lowered)) == lowered
    validate(lowered, 2 * num_ranks, n_microbatches)
    # the pairs share one device: the same time and memory as the unpaired schedule
    plain = simulate(interleaved_1f1b(num_ranks, 2, n_microbatches), 2 * num_ranks)
    overlapped = simulate(lowered, 2 * num_ranks)
    assert overlapped.step_time == plain.step_time and overlapped.peak_activations == plain.peak_activations


def test_compare_schedules() -> None:
    from hyper_parallel.core.pipeline_parallel.compare import compare_schedules, format_table, main

    estimates = {e.name: e for e in compare_schedules(4, 8, 2, memory_limit=4)}
    assert estimates["gpipe"].bubble_fraction == pytest.approx(3 / 11)
    assert estimates["1f1b"].bubble_fraction == pytest.approx(3 / 11)
    assert estimates["interleaved-1f1b"].bubble_fraction == pytest.approx(3 / 19)
    assert (estimates["gpipe"].peak_activations, estimates["1f1b"].peak_activations) == (8, 4)
    ranked = compare_schedules(4, 8, 2, memory_limit=4)
    classic = ("gpipe", "1f1b", "interleaved-1f1b")  # the zero-bubble ones: test_compare_schedules_zero_bubble
    assert [e.name for e in ranked if e.name in classic] == ["1f1b", "interleaved-1f1b", "gpipe"]  # fitting first
    assert [e.name for e in compare_schedules(4, 8, 2) if e.name in classic][0] == "interleaved-1f1b"
    assert "| 1f1b | 4 |" in format_table(ranked)
    main(["--ranks", "2", "--microbatches", "4"])


def test_compare_schedules_zero_bubble(capsys) -> None:
    """The zero-bubble schedules are compared too, each estimate the simulator's result for
    its generator (split backward: I = W = B / 2), DualPipeV only where it applies."""
    from hyper_parallel.core.pipeline_parallel.schedules import (dualpipe_v, interleaved_zero_bubble, v_placement,
                                                                 zbv_zero_bubble)
    from hyper_parallel.core.pipeline_parallel.compare import compare_schedules, main

    estimates = {e.name: e for e in compare_schedules(4, 8, 2)}
    assert set(estimates) == {"gpipe", "1f1b", "interleaved-1f1b", "zbh1", "interleaved-zero-bubble", "zbv",
                              "dualpipev"}
    half = {A.F: 0.5, A.B: 1.0, A.I: 0.5, A.W: 0.5}  # two stages per rank: each half a rank's share
    place = v_placement(4)
    for name, compute, kwargs in (("interleaved-zero-bubble", interleaved_zero_bubble(4, 2, 8), {}),
                                  ("zbv", zbv_zero_bubble(4, 8), {"stage_to_rank": place}),
                                  ("dualpipev", dualpipe_v(4, 8), {"stage_to_rank": place})):
        want = simulate(compute, 8, costs=half, activation_size=0.5, **kwargs)
        got = estimates[name]
        assert (got.num_stages, got.step_time, got.peak_activations) == \
            (8, want.step_time, max(want.peak_activations.values())), name
        assert got.bubble_fraction == pytest.approx(want.bubble_fraction), name
    assert estimates["zbv"].bubble_fraction < estimates["interleaved-zero-bubble"].bubble_fraction \
        < estimates["interleaved-1f1b"].bubble_fraction < estimates["1f1b"].bubble_fraction
    assert estimates["zbh1"] in compare_schedules(4, 8, 1)  # ZB-H1 runs one stage per rank whatever n_virtual
    zbh1 = {e.name: e for e in compare_schedules(4, 6, 1)}  # one stage per rank: no interleaved; 6 < 2 x 4: no DualPipeV
    assert set(zbh1) == {"gpipe", "1f1b", "zbh1", "zbv"}
    assert zbh1["zbh1"].num_stages == 4
    assert zbh1["zbh1"].bubble_fraction < zbh1["1f1b"].bubble_fraction
    assert zbh1["zbh1"].peak_activations <= zbh1["1f1b"].peak_activations  # H1
    main(["--ranks", "4", "--microbatches", "8", "--memory-limit", "4"])
    table = capsys.readouterr().out
    assert table.splitlines()[2].startswith("| zbv | 8 |")  # the fastest that fits
    assert "| dualpipev | 8 |" in table and "| interleaved-zero-bubble | 8 |" in table
