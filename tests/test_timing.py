"""Step timing on the device timeline (gpufeed.measure.timing), tested on the CPU with a simulated device queue."""

from __future__ import annotations

import pytest
import torch

from gpufeed.config import LoaderConfig, TrainConfig
from gpufeed.measure.timing import HostClock, Meter, StepMarks, resolve
from gpufeed.train import Trainer
from gpufeed.train.steps import real_step
from gpufeed.core.world import World


class FakeDevice:
    """An asynchronous device as CUDA events see it: work enqueued at host time t starts once the work queued
    before it is done; a mark is reached when the queue before it has drained and the host has recorded it."""

    def __init__(self) -> None:
        self.host = 0.0
        self.busy_until = 0.0
        self.syncs = 0

    def enqueue(self, seconds: float) -> None:
        self.busy_until = max(self.busy_until, self.host) + seconds

    def mark(self) -> float:
        return max(self.host, self.busy_until)  # in-order queue: later work cannot move an earlier mark

    def sync(self) -> None:
        self.syncs += 1
        self.host = max(self.host, self.busy_until)

    def elapsed(self, a: float, b: float) -> float:
        return b - a


def batches(dev: FakeDevice, waits: list[float]):
    """A loader whose next() keeps the host waiting ``waits[i]`` seconds."""
    for w in waits:
        dev.host += w
        yield (torch.zeros(2, 3, 8, 8, dtype=torch.uint8), torch.zeros(2, dtype=torch.long))


def test_host_wait_while_the_device_is_busy_is_not_idle_time() -> None:
    dev = FakeDevice()
    it = batches(dev, [0.0, 4.0, 25.0])
    steps = []
    for _ in range(3):
        m = StepMarks(dev).begin()
        m.fetch(it, lambda b: (dev.enqueue(1.0), b)[1])  # a 1 s copy on the compute stream
        m.compute(lambda: dev.enqueue(10.0))  # 10 s of queued compute; the host returns at once
        steps.append(m.finish(2))
    assert dev.syncs == 0  # nothing read yet: no per-step wait
    times = resolve(dev, steps)
    assert dev.syncs == 1
    # step 0: nothing queued, no wait. step 1: the host waits 4 s in next() while 11 s are still queued: the
    # device was never idle. step 2: the host comes back at 29 s; the 22 s queued by then ran dry at 22 s: 7 s idle
    assert [t[1] for t in times] == [0.0, 0.0, 7.0]
    assert [t[2] for t in times] == [1.0, 1.0, 1.0]
    assert [t[3] for t in times] == [10.0, 10.0, 10.0]
    assert [t[0] for t in times] == [11.0, 11.0, 18.0]
    assert [t[4] for t in times] == [2, 2, 2]


def test_host_clock_counts_the_whole_wait_on_the_synchronous_cpu() -> None:
    now = iter([0.0, 1.0, 3.5, 3.75, 4.0, 9.0, 9.5]).__next__
    clock = HostClock(now)
    m = StepMarks(clock).begin()  # 0.0
    m.fetch(iter([1]), lambda b: b)  # wait 1.0 -> 3.5, copy -> 3.75
    m.compute(lambda: None)  # 4.0 -> 9.0
    assert m.finish(4).times() == (9.5, 2.5, 0.25, 5.0, 4)


@pytest.fixture(scope="module")
def trainer() -> Trainer:
    cfg = TrainConfig(arch="resnet18", amp="off", progress=False, device="cpu", mode="synthetic", steps=4,
                      num_classes=4, batch_size=2, accum_steps=2, threads=1, log_every=2)
    return Trainer(cfg, LoaderConfig(batch_size=2, num_workers=0, image_size=8, pin_memory=False), World.single())


def test_trainer_steps_and_meter_count_only_device_idle_time(trainer: Trainer, monkeypatch) -> None:
    """The trainer's own step (2 micro-batches) on a simulated asynchronous device: its stall % counts the
    part of the host's wait in next() when the device had nothing queued, read with one sync per log window."""
    dev = FakeDevice()
    monkeypatch.setattr(trainer.compute, "forward_backward", lambda x, y, last: (dev.enqueue(3.0), torch.zeros(()))[1])
    monkeypatch.setattr(trainer.compute, "optimizer_step", lambda: dev.enqueue(1.0))

    def step(it):  # the real mode's step on the simulated device, batches passed through as they are
        return real_step(trainer.compute, dev, it, lambda b: b, batch_size=trainer.batch_size)

    # per step: micro-batch 1 (3 s), micro-batch 2 (3 s + 1 s optimizer); the host waits in next() per fetch
    it = batches(dev, [0.0, 2.0,  # step 0: the 2 s wait falls while micro-batch 1 (3 s) runs: no idle
                       5.0, 1.0])  # step 1: step 0's 7 s queue keeps the device busy through both waits
    meter = Meter(0, 10, World.single(), dev)
    meter.before_step()
    marks = []
    for _ in range(2):
        marks.append(step(it))
        meter.add(marks[-1])
    assert dev.syncs == 1  # the one at the start of the timed window; none per step
    times = resolve(dev, marks)  # a log step: the device drains (at 14 s)
    assert [t[1] for t in times] == [0.0, 0.0] and [t[0] for t in times] == [7.0, 7.0]
    it = batches(dev, [4.0, 5.0])  # step 2: 4 s idle (nothing queued), then 5 s of waiting of which 3 s are busy
    marks = [step(it)]
    meter.add(marks[0])
    assert resolve(dev, marks)[0] == (13.0, 6.0, 0.0, 7.0, 4)
    r = meter.finish()
    assert r.num_steps == 3 and r.num_samples == 12
    assert r.next_wait_s == 6.0 and r.compute_s == 21.0 and r.step_s == 27.0
    assert r.stall_pct == pytest.approx(100 * 6.0 / 27.0)


def test_the_meters_spans_add_up_to_its_stall(trainer: Trainer, monkeypatch) -> None:
    """trace.json's events come from the same marks as the stall %: their sums agree exactly."""
    dev = FakeDevice()
    monkeypatch.setattr(trainer.compute, "forward_backward", lambda x, y, last: (dev.enqueue(3.0), torch.zeros(()))[1])
    monkeypatch.setattr(trainer.compute, "optimizer_step", lambda: dev.enqueue(1.0))
    it = batches(dev, [0.0, 2.0, 9.0, 1.0, 4.0, 0.0])
    meter = Meter(0, 10, World.single(), dev)
    meter.before_step()
    for _ in range(3):
        meter.add(real_step(trainer.compute, dev, it, lambda b: b, batch_size=trainer.batch_size))
    r = meter.finish()
    total = {k: sum(d for kind, _, d in meter.spans if kind == k) for k in ("step", "data wait", "copy", "compute")}
    assert total["step"] == pytest.approx(r.step_s) and total["data wait"] == pytest.approx(r.next_wait_s)
    assert 100 * (total["data wait"] + total["copy"]) / total["step"] == pytest.approx(r.stall_pct)
    starts = [t for kind, t, _ in meter.spans if kind == "step"]
    assert starts == sorted(starts) and starts[0] >= 0.0
