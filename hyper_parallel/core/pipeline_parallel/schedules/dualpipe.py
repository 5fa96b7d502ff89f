"""DualPipeV (DeepSeek-V3's DualPipe, "V" variant; DeepSeek-AI, "DeepSeek-V3 Technical
Report", 2024; the step structure of deepseek-ai/DualPipe's ``dualpipev.py``).

``2 * num_ranks`` stages in the V placement (``zero_bubble.v_placement``: rank ``r`` holds
chunk 0 = stage ``r`` and chunk 1 = stage ``2 * num_ranks - 1 - r``). Each chunk runs its
microbatches in order; in the main phase a forward of one chunk is paired with a backward
of the other (``OVERLAP_B_F``, run on two threads by ``CommComputeOverlap`` so that one's
communication hides under the other's compute), and the warm-up and drain use split
backwards (``I`` now, ``W`` later, FIFO) to fill bubbles. The eight steps per rank ``r``
(``p = num_ranks``, ``m = n_microbatches``):

1. ``2(p - r - 1)`` forwards of chunk 0;
2. ``r + 1`` times: forward chunk 0, forward chunk 1;
3. ``p - r - 1`` times: ``I`` of chunk 1, a deferred ``W``, forward chunk 1;
4. ``m - 2p + r + 1`` times: (forward chunk 0 | backward chunk 1), (forward chunk 1 |
   backward chunk 0) (the very first pair on the last rank runs unpaired);
5. ``p - r - 1`` times: backward chunk 1, (forward chunk 1 | backward chunk 0);
6. ``r + 1`` times: backward chunk 1, backward chunk 0, split (``I``) from the middle on;
7. ``p - r - 1`` times: a deferred ``W``, ``I`` of chunk 0;
8. the remaining deferred ``W``s.
"""

from __future__ import annotations

from hyper_parallel.core.pipeline_parallel.schedules.actions import Action, ActionType, Schedule

A = ActionType


def dualpipe_v(num_ranks: int, n_microbatches: int) -> Schedule:
    """DualPipeV's compute actions (``F``, ``B``, ``I``, ``W``, ``OVERLAP_B_F``) for
    ``2 * num_ranks`` V-placed stages.

    Raises:
        ValueError: ``num_ranks < 1``; ``n_microbatches < 2 * num_ranks`` (the main phase
            needs every rank's pipeline full in both directions).
    """
    if num_ranks < 1:
        raise ValueError(f"dualpipe_v: num_ranks={num_ranks} must be >= 1")
    if n_microbatches < 2 * num_ranks:
        raise ValueError(f"dualpipe_v: n_microbatches={n_microbatches} must be >= 2 * num_ranks = "
                         f"{2 * num_ranks}; use more microbatches or ScheduleZBVZeroBubble")
    p, m = num_ranks, n_microbatches
    schedule: Schedule = {}
    for r in range(p):
        stage = (r, 2 * p - 1 - r)
        next_f, next_b = [0, 0], [0, 0]
        weights: list[Action] = []  # deferred W, FIFO
        actions: list[Action] = []

        def forward(chunk: int) -> Action:
            action = Action(stage[chunk], A.F, next_f[chunk])
            next_f[chunk] += 1
            return action

        def backward(chunk: int, split: bool = False) -> list[Action]:
            mb = next_b[chunk]
            next_b[chunk] += 1
            if not split:
                return [Action(stage[chunk], A.B, mb)]
            weights.append(Action(stage[chunk], A.W, mb))
            return [Action(stage[chunk], A.I, mb)]

        def weight() -> list[Action]:
            return [weights.pop(0)] if weights else []

        def forward_backward(f_chunk: int, b_chunk: int) -> Action:
            f = forward(f_chunk)
            (b,) = backward(b_chunk)
            return Action.overlap(b, f)

        for _ in range(2 * (p - r - 1)):  # step 1
            actions.append(forward(0))
        for _ in range(r + 1):  # step 2
            actions += [forward(0), forward(1)]
        for _ in range(p - r - 1):  # step 3
            actions += backward(1, split=True) + weight() + [forward(1)]
        for i in range(m - 2 * p + r + 1):  # step 4
            if i == 0 and r == p - 1:  # the V's turn: not paired, to shrink the bubble
                actions += [forward(0)] + backward(1)
            else:
                actions.append(forward_backward(0, 1))
            actions.append(forward_backward(1, 0))
        for _ in range(p - r - 1):  # step 5
            actions += backward(1)
            actions.append(forward_backward(1, 0))
        split = False
        for i in range(r + 1):  # step 6
            if i == (r + 1) // 2 and r % 2 == 1:
                split = True
            actions += backward(1, split)
            if i == (r + 1) // 2 and r % 2 == 0:
                split = True
            actions += backward(0, split)
        for _ in range(p - r - 1):  # step 7
            actions += weight() + backward(0, split=True)
        while weights:  # step 8
            actions += weight()
        schedule[r] = actions
    return schedule
