"""The noisy-neighbour detector (gpufeed.measure.contention) and the settled-windows rule (gpufeed.measure.settle):
pure functions with injected numbers, and one real process outside this test's tree."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from gpufeed.measure.contention import (Contention, OtherProcess, contended, largest, node_other_cores,
                                        other_cores)
from gpufeed.measure.settle import MIN_WINDOWS, spread, window_steps


def test_the_threshold_is_half_a_core_or_a_tenth_of_the_machine() -> None:
    assert contended(0.5, 64) and not contended(0.49, 64)
    assert contended(0.25, 2) and not contended(0.2, 2)  # 10% of 2 cores is 0.2: more than that counts
    assert not contended(None, 2) and not contended(0.0, None)
    assert other_cores(1.7, 1.2) == pytest.approx(0.5) and other_cores(0.8, 1.2) == 0.0


def test_a_nodes_ranks_are_not_each_others_neighbours() -> None:
    r0 = Contention(1.0, 4, machine_busy_cores=3.1, own_cores=1.0, own_pids=(10, 11),
                    others=[OtherProcess(20, "rank1", 1.0), OtherProcess(99, "stress", 1.0)])
    r1 = Contention(1.0, 4, machine_busy_cores=2.9, own_cores=1.0, own_pids=(20, 21),
                    others=[OtherProcess(10, "rank0", 1.0), OtherProcess(99, "stress", 0.9)])
    other, big, machine = node_other_cores([r0, r1])
    assert other == pytest.approx(1.0) and machine == 4
    assert big.pid == 99 and big.name == "stress"
    assert node_other_cores([]) == (None, None, None)
    assert largest([OtherProcess(1, "a", 0.1), OtherProcess(2, "b", 0.3)], exclude=[2]).pid == 1


def _busy_outside_our_tree(seconds: float) -> int:
    """A busy loop that is not this process's descendant (double fork: re-parented), its pid."""
    code = ("import os,sys,time\n"
            "if os.fork(): os._exit(0)\n"
            "print(os.getpid(), flush=True)\n"
            f"t=time.time()\nwhile time.time()-t<{seconds}: pass\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    return int(out.stdout.split()[0])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="psutil's process table as on Linux")
def test_telemetry_names_a_busy_process_outside_the_run() -> None:
    from gpufeed.measure.telemetry import Telemetry

    with Telemetry(interval_s=0.1) as tel:
        pid = _busy_outside_our_tree(1.5)
        time.sleep(1.0)
    c = tel.summary().contention
    assert c is not None and os.getpid() in c.own_pids and pid not in c.own_pids
    named = {o.pid: o for o in c.others}
    # the loop ran for the whole window on some core: named as another process, with CPU time of its own
    assert pid in named and named[pid].cores > 0
    assert c.machine_busy_cores >= named[pid].cores * 0.5 and c.other_cores >= 0.0


def test_windows_settle_when_the_interval_of_their_mean_is_narrower_than_the_verdicts_margins() -> None:
    assert spread([100, 102, 99]).settled  # 90% interval of the mean 5% wide
    assert not spread([100, 104, 98]).settled  # 10.2% wide with 3 windows: wider than the 0.9 x ceiling line's 10%
    assert not spread([100, 102]).settled  # fewer than 3 windows
    assert not spread([100, 130, 98]).settled
    assert spread([100, 101, 99], [1.0, 4.9, 0.2]).settled  # a wide stall interval, but every window under 5%
    assert not spread([100, 101, 99], [1.0, 8.0, 2.0]).settled  # across the line, 12.8 points wide
    assert spread([100, 101, 99], [9.0, 12.0, 10.0]).settled  # 5.2 points wide, wholly above the line
    # mean 2, sd 1, 3 windows: 2 x t(2) x 1 / sqrt(3)
    assert spread([100, 101, 99], [1.0, 3.0, 2.0]).stall_spread_pts == pytest.approx(2 * 2.920 / 3 ** 0.5)


def test_more_windows_settle_a_noisy_mode_and_never_unsettle_a_steady_one() -> None:
    """The range of the windows grows with their number; the interval of their mean narrows: a mode whose single
    windows scatter +-20% (one-step windows on a CPU) settles once it has enough of them, as --measure extends it."""
    import random

    rng = random.Random(0)
    noisy = [100 * (1 + rng.uniform(-0.2, 0.2)) for _ in range(200)]
    stalls = [rng.choice((0.0, 40.0)) if i % 4 == 0 else 0.0 for i in range(200)]  # a wait every 4th step or so
    assert not spread(noisy[:3]).settled
    assert spread(noisy[:60]).settled and spread(noisy).settled
    assert spread(noisy).rate_spread < spread(noisy[:60]).rate_spread < spread(noisy[:10]).rate_spread
    assert (max(noisy) - min(noisy)) / 100 > 0.3  # what the old range rule judged: never settled
    steady = [100.0, 101.0, 99.0] * 30
    assert all(spread(steady[:n]).settled for n in range(3, len(steady) + 1))
    assert spread(noisy, stalls).stall_spread_pts is not None
    assert window_steps(20) * MIN_WINDOWS <= 20 and window_steps(1) == 1


def _rank(rank: int, node: int, busy: float, own: float, others: list[OtherProcess], pids: tuple[int, ...]):
    from gpufeed.measure.timing import RankTiming

    return RankTiming(rank=rank, num_steps=3, num_samples=12, wall_s=1.0, step_s=1.0, data_wait_s=0.0,
                      next_wait_s=0.0, h2d_s=0.0, compute_s=1.0, samples_per_s=12.0, stall_pct=0.0,
                      window_rates=[4.0, 4.0, 4.0], window_stalls=[0.0, 0.0, 0.0], node=node,
                      contention=Contention(1.0, 8, busy, own, pids, others))


def test_records_carry_the_cores_others_held_per_node_and_the_verdict_names_them() -> None:
    """Injected telemetry through the records into the verdict: contention on one node of one mode."""
    from gpufeed.measure.verdict import VerdictInputs, classify
    from gpufeed.train.records import aggregate
    from gpufeed.train.verdict_inputs import mode_neighbours

    hog = OtherProcess(555, "yes", 2.0)
    quiet = aggregate("synthetic", [_rank(0, 0, 2.1, 2.0, [], (1,)), _rank(1, 1, 2.0, 2.0, [], (2,))], 2, judge=True)
    busy = aggregate("real", [_rank(0, 0, 2.1, 2.0, [], (1,)), _rank(1, 1, 4.1, 2.0, [hog], (2,))], 2, judge=True)
    assert quiet.other_cores == pytest.approx(0.1) and quiet.settled
    assert [n.other_cores for n in busy.per_node] == [pytest.approx(0.1), pytest.approx(2.1)]
    assert busy.other_cores == pytest.approx(2.1) and busy.other_process == hog
    n = mode_neighbours({"synthetic": quiet, "real": busy})
    assert [(x.mode, x.node, x.pid) for x in n] == [("synthetic", 0, None), ("real", 1, 555)]
    v = classify(VerdictInputs(stall_pct=1.0, end_to_end_rate=24.0, gpu_ceiling=24.0, neighbours=n))
    assert v.status == "inconclusive" and "2.10 of 8 cores in the real mode" in v.reason and "yes (pid 555" in v.reason
    calm = classify(VerdictInputs(stall_pct=1.0, end_to_end_rate=24.0, gpu_ceiling=24.0, neighbours=n[:1]))
    assert calm.status == "fed"
