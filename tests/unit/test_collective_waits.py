"""What a rank spends blocked in its SP group's collectives (``flexorch.workers.attention.collective_waits``), on
real processes over real gloo: the member that arrives late at a ring hop or a Ulysses all-to-all blocks little,
the one that waited for it blocks for the difference, so ``solver.worker_speeds`` can tell which member set the
group's pace."""

from __future__ import annotations

import time

import pytest
import torch

from tests._dist_utils import DistPool

LATE_S = 0.3


def _waits_job(ctx):
    from flexorch.workers.attention.collective_waits import WAITS
    from flexorch.workers.attention.ring import _Ring
    from flexorch.workers.attention.ulysses import seq_to_head

    with ctx.registry() as reg:
        reg.ensure([(0, 1)])
        group = reg.group((0, 1))
        got = {}
        x = torch.randn(8, 4, 2)  # (s/d, h, hd)
        for what in ("ring", "ulysses"):
            WAITS.take_ms()
            if ctx.rank == 1:  # the late (slow) member
                time.sleep(LATE_S)
            if what == "ring":
                _Ring(group).start(x, tag=7).wait()
            else:
                seq_to_head(x, group)
            got[what] = WAITS.take_ms()
        return got


@pytest.fixture(scope="module")
def pool():
    p = DistPool(2)
    yield p
    p.close()


def test_the_member_that_waited_for_a_late_one_says_so_and_the_late_one_does_not(pool):
    early, late = pool.run(_waits_job)
    for what in ("ring", "ulysses"):
        assert early[what] >= 0.8 * LATE_S * 1e3, (what, early, late)
        assert late[what] < 0.5 * LATE_S * 1e3, (what, early, late)


def test_take_starts_the_count_again():
    from flexorch.workers.attention.collective_waits import CollectiveWaits

    w = CollectiveWaits()
    with w.blocked():
        time.sleep(0.02)
    assert w.take_ms() >= 15.0
    assert w.take_ms() == 0.0
