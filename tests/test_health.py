"""GPU health during train (gpufeed.measure.health, gpufeed.measure.nvml) with a scripted fake pynvml: no GPU needed."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpufeed.measure.health import HealthSampler, slowdowns, throttled
from gpufeed.measure.nvml import THROTTLE_BITS, decode_reasons, read_health, read_reasons
from gpufeed.core.records import to_jsonable
from gpufeed.train.records import TrainRecord
from gpufeed.train.report import health_markdown, render, render_markdown, throttle_notes, write_report


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):  # noqa: N801 - pynvml's name
    pass


class FakeNvml:
    """The pynvml functions HealthSampler calls, answering from ``script`` (one dict per sample, the last one
    repeated); the fan is not supported (an SXM board)."""

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1

    def __init__(self, script: list[dict], *, new_api: bool = True) -> None:
        self.script, self.i = script, -1
        self.shutdowns = 0
        if not new_api:  # nvidia-ml-py before 12.535 has only the "throttle" name
            self.nvmlDeviceGetCurrentClocksThrottleReasons = self._reasons

    def _now(self) -> dict:
        return self.script[min(self.i, len(self.script) - 1)]

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return f"h{index}"

    def nvmlDeviceGetUtilizationRates(self, h):
        self.i += 1  # the first query of a sample moves the script on
        return SimpleNamespace(gpu=self._now()["util"], memory=0)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=self._now()["mem"], total=80 << 30)

    def nvmlDeviceGetPowerUsage(self, h) -> int:
        return self._now()["mw"]

    def nvmlDeviceGetEnforcedPowerLimit(self, h) -> int:
        return 700_000

    def nvmlDeviceGetTemperature(self, h, sensor) -> int:
        return self._now()["temp"]

    def nvmlDeviceGetFanSpeed(self, h) -> int:
        raise NVMLError_NotSupported("Not Supported")

    def nvmlDeviceGetClockInfo(self, h, clock) -> int:
        return self._now()["sm"]

    def _reasons(self, h) -> int:
        return self._now()["bits"]

    def __getattr__(self, name: str):
        if name == "nvmlDeviceGetCurrentClocksEventReasons" and "nvmlDeviceGetCurrentClocksThrottleReasons" \
                not in self.__dict__:
            return self._reasons
        raise AttributeError(name)


def step(util=50, mem=1 << 30, mw=300_000, temp=60, sm=1980, bits=0) -> dict:
    return {"util": util, "mem": mem, "mw": mw, "temp": temp, "sm": sm, "bits": bits}


class Clock:
    def __init__(self, times: list[float]) -> None:
        self.times, self.i = times, -1

    def __call__(self) -> float:
        self.i += 1
        return self.times[self.i]


def sampled(script: list[dict], times: list[float], **kw) -> HealthSampler:
    s = HealthSampler(0, nvml=FakeNvml(script, **kw), clock=Clock(times), host="h")
    for _ in times:
        s.sample()
    return s


# --------------------------------------------------------------------------- decoding and fields


@pytest.mark.parametrize("bit,name", list(THROTTLE_BITS.items()))
def test_each_reason_bit_decodes_to_its_name(bit, name) -> None:
    assert decode_reasons(bit) == (name,)
    assert decode_reasons(bit | 0x4) == tuple(n for b, n in THROTTLE_BITS.items() if b in (bit, 0x4))


def test_reason_decoding_takes_only_integers_and_known_bits() -> None:
    assert decode_reasons(0x4 | 0x40 | 0x10000) == ("sw_power_cap", "hw_thermal_slowdown")
    assert decode_reasons(None) == () and decode_reasons("4") == () and decode_reasons(True) == ()


@pytest.mark.parametrize("new_api", [True, False])
def test_reasons_come_from_either_nvml_name(new_api) -> None:
    n = FakeNvml([step(bits=0x20)], new_api=new_api)
    n.i = 0
    assert read_reasons(n, "h0") == 0x20


def test_an_unsupported_field_is_none_and_the_rest_are_read() -> None:
    n = FakeNvml([step(util=93, mem=5 << 30, mw=651_500, temp=71, sm=1755, bits=0x4)])
    n.nvmlDeviceGetUtilizationRates("h0")
    n.nvmlDeviceGetUtilizationRates = lambda h: (_ for _ in ()).throw(NVMLError("Unknown Error"))
    s = read_health(n, "h0")
    assert s == {"util_pct": None, "mem_used_bytes": float(5 << 30), "power_w": 651.5, "power_limit_w": 700.0,
                 "temp_c": 71.0, "fan_pct": None, "sm_clock_mhz": 1755.0, "reasons": 0x4}


def test_without_nvml_the_sampler_is_unavailable_and_samples_nothing() -> None:
    class Broken(FakeNvml):
        def nvmlInit(self) -> None:
            raise NVMLError("NVML Shared Library Not Found")

    s = HealthSampler(0, nvml=Broken([step()]))
    assert not s.available and "NVML Shared Library Not Found" in s.error
    s.sample()
    assert s.result() is None and s.rows == []


# --------------------------------------------------------------------------- series and summary


def test_summary_and_throttle_seconds_over_the_sample_intervals() -> None:
    # samples at 0, 1, 3, 4, 6 s; each stands for the time since the previous one
    script = [step(util=40, mw=300_000, temp=60, sm=1980, bits=0x1),           # idle at the start: 0 s
              step(util=90, mw=690_000, temp=75, sm=1800, bits=0x4),           # power cap: 1 s
              step(util=100, mw=700_000, temp=83, sm=1500, bits=0x4 | 0x20),   # power cap + SW thermal: 2 s
              step(util=100, mw=650_000, temp=80, sm=1600, bits=0x8 | 0x40),   # HW slowdown + HW thermal: 1 s
              step(util=70, mw=500_000, temp=70, sm=1900, bits=0x80 | 0x8)]    # HW power brake + HW slowdown: 2 s
    h = sampled(script, [10.0, 11.0, 13.0, 14.0, 16.0]).result()
    assert h.num_samples == 5 and h.duration_s == 6.0
    assert h.throttle_s == {"gpu_idle": 0.0, "sw_power_cap": 3.0, "sw_thermal_slowdown": 2.0, "hw_slowdown": 3.0,
                            "hw_thermal_slowdown": 1.0, "hw_power_brake_slowdown": 2.0}
    assert h.temp_max_c == 83.0 and h.power_max_w == 700.0 and h.power_mean_w == pytest.approx(568.0)
    assert h.power_limit_w == 700.0 and h.util_mean_pct == pytest.approx(80.0)
    assert h.sm_clock_min_mhz == 1500.0 and h.sm_clock_mean_mhz == pytest.approx(1756.0)
    assert h.fan_mean_pct is None and h.mem_used_max_bytes == float(1 << 30)


def test_the_series_is_bounded_and_keeps_every_sample_in_its_rows() -> None:
    n = 1000
    script = [step(util=i % 100, temp=50 + (i == 700) * 40, bits=0x4 if i >= 900 else 0) for i in range(n)]
    s = sampled(script, [float(i) for i in range(n)])
    s2 = HealthSampler(0, nvml=FakeNvml(script), clock=Clock([float(i) for i in range(n)]), max_rows=64)
    for _ in range(n):
        s2.sample()
    rows = s2.rows
    # 600 one-second rows fill the series; they merge into 300 two-second rows, and 400 s more add 200 rows
    assert len(s.rows) == 500 and s.span_s == 2.0 and [r["n"] for r in s.rows] == [2] * 500
    assert len(rows) <= 64 and s2.span_s == 16.0
    assert sum(r["n"] for r in rows) == n and sum(r["dt_s"] for r in rows) == pytest.approx(n - 1)
    assert [r["t_s"] for r in rows] == sorted(r["t_s"] for r in rows)
    assert max(r["temp_c"] for r in rows) == 90.0  # a max survives the merges
    mean = sum(r["util_pct"] * r["n"] for r in rows) / n
    assert mean == pytest.approx(sum(i % 100 for i in range(n)) / n)  # the means are kept per sample
    assert all(r["fan_pct"] is None for r in rows)
    assert [r["reasons"] for r in rows if r["t_s"] >= 900] == [["sw_power_cap"]] * len(
        [r for r in rows if r["t_s"] >= 900])
    assert s2.result().throttle_s["sw_power_cap"] == 100.0  # the summary is exact whatever the rows


def test_the_sampler_thread_samples_until_stopped_and_shuts_nvml_down() -> None:
    n = FakeNvml([step(bits=0x4)])
    s = HealthSampler(0, nvml=n, interval_s=0.01).start()
    for _ in range(1000):
        if s.num_samples >= 3:
            break
        time.sleep(0.01)
    s.stop()
    count = s.num_samples
    s.stop()
    assert s.num_samples == count and n.shutdowns == 1 and s.result().num_samples == count


# --------------------------------------------------------------------------- summary.json and report.md


def _summary(tmp_path: Path, health: list, verdict: bool = True) -> dict:
    from gpufeed.measure.verdict import Verdict

    v = Verdict(status="fed", reason="stall 1.0 % < 5 %", bound=None) \
        if verdict else None
    rec = TrainRecord(mode="measure", arch="resnet50", device="cuda:0", backend="nccl", world_size=len(health) or 1,
                      num_nodes=1, amp="bf16", batch_size=256, accum_steps=1, global_batch=256, image_size=224,
                      num_classes=1000, start_step=0, step=0, total_steps=0, epoch=0, final_loss=None, final_lr=0.1,
                      modes={}, val=[], verdict=v, ok=True, started="now", gpu_health=health)
    write_report(tmp_path, rec)
    return json.loads((tmp_path / "summary.json").read_text())


def _gpu(bits_from: int, total: int = 600, rank: int = 0) -> object:
    script = [step(bits=0x4 if i >= bits_from else 0x1) for i in range(total + 1)]
    s = HealthSampler(rank, rank=rank, nvml=FakeNvml(script), clock=Clock([float(i) for i in range(total + 1)]),
                      host="node-a")
    for _ in range(total + 1):
        s.sample()
    return s.result()


def test_summary_json_holds_each_gpus_health(tmp_path: Path) -> None:
    s = _summary(tmp_path, [_gpu(559)])
    h = s["gpu_health"][0]
    assert h["rank"] == 0 and h["gpu"] == 0 and h["host"] == "node-a" and h["num_samples"] == 601
    assert h["duration_s"] == 600.0 and h["throttle_s"] == {"gpu_idle": 558.0, "sw_power_cap": 42.0}
    assert h["temp_max_c"] == 60.0 and h["power_limit_w"] == 700.0 and h["fan_mean_pct"] is None
    assert slowdowns(h) == {"sw_power_cap": 42.0} and throttled(h) == {"sw_power_cap": 42.0}


def test_a_throttled_run_says_so_next_to_its_verdict(tmp_path: Path) -> None:
    s = _summary(tmp_path, [_gpu(559), _gpu(10_000, rank=1)])
    note = "GPU 0 throttled (power cap) for 42 s of 600 s sampled: the GPU ceiling measured before the run may " \
           "overstate what it delivered"
    assert throttle_notes(s) == [note]  # GPU 1 never throttled
    md = (tmp_path / "report.md").read_text()
    assert "## GPU health" in md and "| GPU 0 | 0 | 601 | 60 | 300/300 | 700 | 50 | 1980/1980 | - | power cap 42 s |" in md
    assert "| GPU 1 | 1 | 601 | 60 | 300/300 | 700 | 50 | 1980/1980 | - | none |" in md
    after = md.split("**Verdict: fed**", 1)[1]
    assert after.splitlines()[1] == f"- **Note:** {note}"
    text = render(s).splitlines()
    assert text[text.index("verdict: FED: stall 1.0 % < 5 %") + 1] == f"  note: {note}"


def test_throttling_under_the_threshold_or_benign_reasons_add_no_note(tmp_path: Path) -> None:
    s = _summary(tmp_path, [_gpu(599)])  # 2 s of power cap: not more than 2 s
    assert s["gpu_health"][0]["throttle_s"]["sw_power_cap"] == 2.0 and throttle_notes(s) == []
    assert "Note:" not in (tmp_path / "report.md").read_text()
    assert "| power cap 2 s |" in (tmp_path / "report.md").read_text()  # the table still shows it
    s = _summary(tmp_path, [_gpu(10_000)])  # idle (benign) the whole time
    assert throttle_notes(s) == [] and "| none |" in (tmp_path / "report.md").read_text()


def test_without_a_verdict_the_note_ends_the_health_section(tmp_path: Path) -> None:
    s = _summary(tmp_path, [_gpu(501)], verdict=False)
    assert health_markdown(s)[-1].startswith("GPU 0 throttled (power cap) for 100 s of 600 s sampled")
    assert render(s).splitlines()[-1].startswith("note: GPU 0 throttled (power cap) for 100 s")


def test_no_gpu_sampled_is_one_line(tmp_path: Path) -> None:
    s = _summary(tmp_path, [])
    assert s["gpu_health"] == [] and health_markdown(s) == ["GPU health: not sampled (no NVML GPU)"]
    md = render_markdown(to_jsonable(s))
    assert "GPU health: not sampled (no NVML GPU)" in md and "## GPU health" not in md


# --------------------------------------------------------------------------- inside train


def test_start_health_samples_a_cuda_ranks_gpu_and_none_without_nvml(monkeypatch) -> None:
    from gpufeed.train import start_health
    from gpufeed.core.world import World

    assert start_health(World.single("cpu")) is None
    fake = FakeNvml([step()])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    world = World(rank=3, world_size=4, local_rank=1, device="cuda:1", backend="nccl", node_rank=1)
    s = start_health(world)
    try:
        assert s is not None and s.handle == "h1" and (s.rank, s.node, s.gpu) == (3, 1, 1) and s.num_samples >= 1
    finally:
        s.stop()

    class Broken(FakeNvml):
        def nvmlInit(self) -> None:
            raise NVMLError("Driver Not Loaded")

    monkeypatch.setitem(sys.modules, "pynvml", Broken([step()]))
    assert start_health(world) is None


def test_a_train_run_writes_the_series_and_the_summary_of_its_sampled_gpu(tmp_path: Path, monkeypatch) -> None:
    """The one train launch of this module: a CPU run whose rank is handed a scripted GPU sampler."""
    import gpufeed.train as train_mod
    from gpufeed.core.world import World
    from tests.test_train import LOADER, tiny

    def scripted(world):
        return HealthSampler(0, rank=world.rank, nvml=FakeNvml([step(temp=85, bits=0x40 | 0x8)]),
                             clock=Clock([0.0, 50.0]), interval_s=3600.0).start()

    run = tmp_path / "run"
    rec = train_mod.train(tiny(mode="synthetic", steps=1), LOADER, World.single(), run_dir=run, health=scripted)
    assert [(h.rank, h.num_samples, h.duration_s, h.temp_max_c) for h in rec.gpu_health] == [(0, 2, 50.0, 85.0)]
    rows = [json.loads(line) for line in (run / "gpu_health.jsonl").read_text().splitlines()]
    assert [(r["rank"], r["t_s"], r["dt_s"], r["n"], r["temp_c"], r["fan_pct"], r["reasons"]) for r in rows] == \
        [(0, 0.0, 50.0, 2, 85.0, None, ["hw_slowdown", "hw_thermal_slowdown"])]  # one row: 2 samples in a 3600 s span
    s = json.loads((run / "summary.json").read_text())
    assert s["gpu_health"][0]["throttle_s"] == {"hw_slowdown": 50.0, "hw_thermal_slowdown": 50.0}
    md = (run / "report.md").read_text()
    assert "## GPU health" in md and "not sampled" not in md
    assert "GPU 0 throttled (HW slowdown 50 s, HW thermal 50 s) of 50 s sampled" in md
