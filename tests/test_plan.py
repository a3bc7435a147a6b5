"""gpufeed plan: measured peak memory, its linear model and check, the fit, the loader cores per GPU, the CLI.

One small plan (resnet18 on the CPU, 32 px, measured at batches 128 and 256, checked at 384) is shared by most tests:
from batch 128 on its activations outweigh its gradients, so the peak grows with the batch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gpufeed.config import PlanConfig
from gpufeed.core.errors import ConfigError, DataError
from tests.common.cli import invoke, invoke_json

GIB = 1 << 30


@pytest.fixture(scope="module")
def report():  # type: ignore[no-untyped-def]
    from gpufeed.memplan import plan

    return plan(PlanConfig(arch="resnet18", num_classes=10, batch_size=64, image_size=32, device="cpu",
                           measure_batches=(128, 256), check_batch=384, gpu_memory=GIB))


def _param_bytes(num_classes: int = 10) -> tuple[int, int]:
    import torchvision

    m = torchvision.models.resnet18(num_classes=num_classes)
    return (sum(p.numel() * p.element_size() for p in m.parameters()),
            sum(b.numel() * b.element_size() for b in m.buffers()))


def _estimate(r, b: int) -> float:  # type: ignore[no-untyped-def]
    """The plan's model: the higher of the measured peaks' line and the floor line."""
    return max(r.fixed_bytes + r.per_sample_bytes * b, r.floor_fixed_bytes + r.floor_per_sample_bytes * b)


def test_the_check_error_is_computed_from_the_measurements_and_small(report) -> None:  # type: ignore[no-untyped-def]
    m1, m2 = report.measurements
    assert (m1.batch_size, m2.batch_size, report.check.batch_size) == (128, 256, 384)
    # the line goes through both measured peaks
    assert report.fixed_bytes + report.per_sample_bytes * 128 == pytest.approx(m1.peak_bytes)
    assert report.fixed_bytes + report.per_sample_bytes * 256 == pytest.approx(m2.peak_bytes)
    est = round(_estimate(report, 384))
    assert report.check_estimate_bytes == est
    err = (est - report.check.peak_bytes) / report.check.peak_bytes * 100
    assert report.check_error_pct == pytest.approx(err)
    assert abs(err) < 15
    # the peaks are real and grow with the batch: above model + optimizer state, and rising
    weights, _ = _param_bytes()
    assert m1.peak_bytes > 2 * weights and m1.peak_bytes < m2.peak_bytes < report.check.peak_bytes
    assert 0 < m1.activation_bytes < m2.activation_bytes


def test_the_parts_are_the_real_tensors_and_add_up_to_the_peak(report) -> None:  # type: ignore[no-untyped-def]
    params, buffers = _param_bytes()
    e = report.estimate
    assert e.weights_bytes == params + buffers
    assert e.gradients_bytes == params  # fp32 parameters: one fp32 gradient each
    assert e.optimizer_state_bytes == params  # SGD with momentum: one buffer per parameter
    assert e.peak_bytes == round(_estimate(report, 64))
    # the floor line: weights, optimizer state and the activations' line
    assert report.floor_fixed_bytes == params + buffers + params + report.activation_fixed_bytes
    assert report.floor_per_sample_bytes == report.activation_per_sample_bytes
    assert e.activations_bytes == round(report.activation_fixed_bytes + report.activation_per_sample_bytes * 64)
    assert e.weights_bytes + e.gradients_bytes + e.optimizer_state_bytes + e.activations_bytes + e.other_bytes \
        == e.peak_bytes


def test_adamw_state_is_two_tensors_per_parameter_and_a_step_count() -> None:
    import torch

    from gpufeed.memplan import Stepper

    s = Stepper(PlanConfig(arch="resnet18", num_classes=10, image_size=16, optimizer="adamw"), torch.device("cpu"),
                "off")
    s.step(2)
    params = list(s.model.parameters())
    expected = sum(t.numel() * t.element_size() for st in s.optimizer.state.values() for t in st.values())
    weights, grads, opt_state = s.state_bytes()
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    assert opt_state == expected == 2 * param_bytes + 4 * len(params)  # exp_avg, exp_avg_sq, float32 step
    assert grads == param_bytes


def test_the_largest_fitting_batch_follows_the_line_and_the_headroom(report) -> None:  # type: ignore[no-untyped-def]
    from gpufeed.memplan import max_fitting_batch

    assert report.usable_memory_bytes == int(GIB * 0.9)
    b = report.max_batch_size
    assert _estimate(report, b) <= report.usable_memory_bytes < _estimate(report, b + 1)
    assert report.fits is True and report.ok is True and 64 <= b < 65536
    assert max_fitting_batch(100.0, 10.0, 1000.0) == 90
    assert max_fitting_batch(100.0, 10.0, 109.0) == 0


def test_the_floor_line_lifts_an_estimate_whose_measured_line_is_nearly_flat() -> None:
    """Where the gradients set both measured peaks, the line through them is nearly flat; at a large batch the
    estimate must still hold weights + optimizer state + activations, which the floor line carries."""
    from gpufeed.memplan import peak_estimate

    # measured peaks 100 MB + 0.1 MB x b; floor 60 MB + 1 MB x b: the floor wins from b = 45 on
    assert peak_estimate(100e6, 0.1e6, 60e6, 1e6, 4) == 100_400_000
    assert peak_estimate(100e6, 0.1e6, 60e6, 1e6, 512) == 572_000_000


def test_a_measured_estimate_is_the_higher_line_and_holds_the_forward_pass() -> None:
    """Which line is higher at 32 px depends on the CPU's allocator (Intel and AMD differ): the estimate is the
    higher of the two, whichever that is, and never below weights + optimizer state + activations."""
    from gpufeed.memplan import plan

    r = plan(PlanConfig(arch="resnet18", num_classes=10, batch_size=512, image_size=32, device="cpu",
                        measure_batches=(2, 4), check_batch=0))
    e = r.estimate
    assert e.peak_bytes == max(round(r.fixed_bytes + r.per_sample_bytes * 512),
                               round(r.floor_fixed_bytes + r.floor_per_sample_bytes * 512))
    assert e.peak_bytes >= e.weights_bytes + e.optimizer_state_bytes + e.activations_bytes


def test_default_measure_batches_start_where_activations_outweigh_gradients() -> None:
    from gpufeed.memplan import default_measure_batches

    # 45 MB of gradients, 1.4 MB of activations per sample: 2 x 45 / 1.4 = 64.3 -> 128
    assert default_measure_batches("cpu", 45_000_000, 1_400_000) == (128, 256)
    assert default_measure_batches("cpu", 100, 1_000) == (2, 4)
    assert default_measure_batches("cuda", 100, 1_000) == (16, 32)


def _tune_record(tmp_path: Path) -> Path:
    p = tmp_path / "tune.json"
    p.write_text(json.dumps({"ok": True, "best_trial": 3, "trials": [
        {"trial": 1, "num_workers": 1, "samples_per_core_s": 999.0},
        {"trial": 3, "num_workers": 4, "samples_per_s": 1000.0, "tree_cores_used": 4.0,
         "samples_per_core_s": 250.0}]}))
    return p


def _train_record(tmp_path: Path) -> Path:
    p = tmp_path / "train.json"
    p.write_text(json.dumps({"world_size": 2, "modes": {
        "synthetic": {"samples_per_s": 2400.0},
        "loader-only": {"samples_per_s": 900.0, "loader_cores_used": 3.0}}}))
    return p


def test_cores_per_gpu_from_a_tune_record_and_a_target_rate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpufeed.core import system
    from gpufeed.memplan import plan_cores

    monkeypatch.setattr(system, "usable_cpus", lambda: 16)
    c = plan_cores(PlanConfig(record=str(_tune_record(tmp_path)), target_rate=1000.0), gpus=2)
    assert c.samples_per_core_s == 250.0 and c.loader_cores_per_gpu == 4.0
    assert c.rate_source.endswith("(tune best trial 3, 4 workers)") and c.target_source == "--target-rate"
    assert c.usable_cores_per_gpu == 8.0 and c.enough  # 4 loader + 1 trainer <= 8
    c = plan_cores(PlanConfig(record=str(_tune_record(tmp_path)), target_rate=1900.0), gpus=2)
    assert c.loader_cores_per_gpu == 7.6 and not c.enough  # 7.6 + 1 > 8


def test_cores_per_gpu_from_a_train_record_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpufeed.core import system
    from gpufeed.memplan import plan_cores

    monkeypatch.setattr(system, "usable_cpus", lambda: 4)
    c = plan_cores(PlanConfig(record=str(_train_record(tmp_path))), gpus=1)
    # 900 samples/s on 3 cores = 300 per core; 2400 synthetic samples/s over 2 ranks = 1200 per GPU -> 4 cores
    assert (c.samples_per_core_s, c.target_rate, c.loader_cores_per_gpu) == (300.0, 1200.0, 4.0)
    assert not c.enough  # 4 + 1 > 4


def test_a_record_that_is_neither_tune_nor_train_is_refused(tmp_path: Path) -> None:
    from gpufeed.memplan import plan_cores

    p = tmp_path / "x.json"
    p.write_text('{"trials": "no", "modes": 3}')
    with pytest.raises(DataError, match="neither a gpufeed tune nor a train summary.json"):
        plan_cores(PlanConfig(record=str(p), target_rate=10.0), gpus=1)
    with pytest.raises(ConfigError, match="target_rate needs record"):
        PlanConfig(target_rate=10.0)


def test_cli_end_to_end_json(tmp_path: Path) -> None:
    rec = invoke_json(["plan", "--arch", "resnet18", "--num-classes", "10", "--image-size", "16", "--batch-size",
                       "32", "--device", "cpu", "--measure-batches", "2", "4", "--check-batch", "8",
                       "--gpu-memory", "2GiB", "--record", _tune_record(tmp_path), "--target-rate", "100"])
    assert {"ok", "arch", "measurements", "estimate", "check", "check_error_pct", "fixed_bytes", "per_sample_bytes",
            "gpu_memory_bytes", "headroom", "max_batch_size", "fits", "cores", "method", "notes"} <= set(rec)
    assert rec["ok"] is True and rec["fits"] is True and rec["gpu_memory_bytes"] == 2 * GIB
    assert [m["batch_size"] for m in rec["measurements"]] == [2, 4] and rec["check"]["batch_size"] == 8
    assert set(rec["estimate"]) == {"batch_size", "weights_bytes", "gradients_bytes", "optimizer_state_bytes",
                                    "activations_bytes", "other_bytes", "peak_bytes"}
    assert rec["cores"]["loader_cores_per_gpu"] == pytest.approx(0.4)  # 100 / 250
    assert math.isfinite(rec["check_error_pct"])


def test_cli_batch_that_does_not_fit_exits_1(tmp_path: Path) -> None:
    # resnet18's weights, gradients and momentum are ~134 MB: 100 MiB holds not even one sample
    r = invoke(["plan", "--arch", "resnet18", "--image-size", "16", "--device", "cpu", "--measure-batches", "2", "4",
                "--check-batch", "0", "--gpu-memory", "100MiB", "--batch-size", "8"], expect=1)
    assert "batch 8 does NOT fit; the largest batch that fits is 0" in r.stdout
    assert "check:" not in r.stdout


@pytest.mark.parametrize("args, needle", [
    (["--arch", "resnet9"], "'resnet9' is not one of"),
    (["--batch-size", "0"], "batch_size must be >= 1, got 0"),
    (["--measure-batches", "8", "4"], "measure_batches must be two batch sizes, smaller first"),
    (["--measure-batches", "1", "4"], "within 2..65536 (BatchNorm trains on 2 samples or more)"),
    (["--check-batch", "1"], "check_batch must be 0 (no check) or at least 2"),
    (["--measure-batches", "2", "4", "--check-batch", "4"], "check_batch 4 is one of measure_batches (2, 4)"),
    (["--target-rate", "100"], "target_rate needs record"),
    (["--device", "tpu"], "device must be auto, cpu, cuda or cuda:N"),
])
def test_bad_input_exits_2_with_one_sentence(args: list[str], needle: str) -> None:
    r = invoke(["plan", *args], expect=2)
    err = [line for line in r.stderr.splitlines() if line.lower().startswith("error")]
    assert len(err) == 1 and needle in err[0], r.stderr


def test_a_bad_record_exits_2_before_measuring(tmp_path: Path) -> None:
    p = tmp_path / "r.json"
    p.write_text("not json")
    r = invoke(["plan", "--arch", "resnet18", "--device", "cpu", "--record", p, "--target-rate", "10"], expect=2)
    assert r.stderr.strip().splitlines() == [f"error: {p} is not readable JSON, so not a gpufeed tune or train "
                                             f"summary.json (Expecting value: line 1 column 1 (char 0))"]


def test_a_plan_section_in_a_config_file(tmp_path: Path) -> None:
    from gpufeed.config import load_config

    p = tmp_path / "c.toml"
    p.write_text('[plan]\narch = "resnet18"\nmeasure_batches = [4, 8]\ngpu_memory = "80GiB"\n')
    cfg = load_config(p).plan
    assert (cfg.arch, cfg.measure_batches, cfg.gpu_memory) == ("resnet18", (4, 8), 80 * GIB)
    p.write_text("[plan]\nmeasure_batches = [4]\n")
    with pytest.raises(ConfigError, match="measure_batches must be two batch sizes"):
        load_config(p)


def test_the_check_is_never_one_of_the_measured_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The line goes through the two measured batches: a check at one of them would print an error near 0% that
    checks nothing. The derived measure batches are known only after the warm-up step: refused then, exit 2."""
    from gpufeed import memplan as plan_mod

    monkeypatch.setattr(plan_mod, "default_measure_batches", lambda *a: (2, 4))
    with pytest.raises(ConfigError, match="check_batch 2 is one of the measured batches 2 and 4"):
        plan_mod.plan(PlanConfig(arch="resnet18", num_classes=10, batch_size=4, image_size=16, device="cpu",
                                 check_batch=2))


def test_a_record_whose_rate_per_core_is_not_finite_is_refused(tmp_path: Path) -> None:
    """Each number of the record is within bounds, but 1e12 samples/s on 1e-300 cores is an infinite rate per
    core: refused in one sentence, not "inf samples/s per core" and Infinity in --json."""
    from gpufeed.memplan import loader_rates

    p = tmp_path / "summary.json"
    p.write_text(json.dumps({"modes": {"loader-only": {"samples_per_s": 1e12, "loader_cores_used": 1e-300}}}))
    with pytest.raises(DataError, match="samples/s per core .* is not a positive rate|1e-300, not a measured rate"):
        loader_rates(str(p))
    p.write_text(json.dumps({"trials": [{"trial": 0, "samples_per_s": 1e12, "tree_cores_used": 1e-300}],
                             "best_trial": 0}))
    with pytest.raises(DataError, match="samples/s per core .* is not a positive rate|1e-300, not a measured rate"):
        loader_rates(str(p))


def test_a_cuda_index_beyond_the_devices_is_refused_before_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    """--device cuda:3 on a machine with one GPU: one sentence, exit 2 (torch would raise "invalid device ordinal"
    deep in the first step, an 'unexpected' exit 1)."""
    import torch

    from gpufeed.memplan import plan

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(DataError, match=r"device cuda:3 asked for, but torch sees 1 CUDA device\(s\)"):
        plan(PlanConfig(arch="resnet18", device="cuda:3"))
