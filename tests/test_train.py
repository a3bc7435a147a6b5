from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from gpufeed.config import LoaderConfig, TrainConfig
from gpufeed.errors import ConfigError
from gpufeed.train import Trainer, launch, lr_at, torchrun_command, train
from gpufeed.world import World
from tests.conftest import invoke
from tests.train_shards import write_tiny_shards

LOADER = LoaderConfig(batch_size=4, num_workers=0, image_size=32, shuffle_buffer=16, decode="pil", pin_memory=False)


def tiny(**kw) -> TrainConfig:
    base = dict(arch="resnet18", amp="off", progress=False, log_every=1, timing_warmup_steps=1, device="cpu",
                lr=0.05, threads=1)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("train-shards")
    return {
        "train": write_tiny_shards(root / "train", [16, 16, 16, 16]),
        "uneven": write_tiny_shards(root / "uneven", [5, 40, 3, 16], seed=1),
        "val": write_tiny_shards(root / "val", [10, 6], seed=2, prefix="val"),
    }


def read_log(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]


# --------------------------------------------------------------------------- pure pieces


def test_lr_warmup_then_cosine() -> None:
    lrs = [lr_at(s, total=10, warmup=2, peak=1.0) for s in range(10)]
    assert lrs[0] == pytest.approx(0.5) and lrs[1] == pytest.approx(1.0)
    assert lrs[2] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))
    assert lr_at(10, total=10, warmup=2, peak=1.0, floor=0.1) == pytest.approx(0.1)


def test_torchrun_command_rendezvous_options(tmp_path: Path) -> None:
    cmd = torchrun_command(tiny(nproc_per_node=2), tmp_path / "c.toml")
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and "--standalone" in cmd
    assert cmd[-3:] == ["-m", "gpufeed.train", str(tmp_path / "c.toml")]
    cmd = torchrun_command(tiny(nproc_per_node=8, nnodes="2", rdzv_endpoint="node0:29400", rdzv_id="job7"), "c")
    assert ["--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:29400", "--rdzv-id", "job7"] == cmd[7:13]
    cmd = torchrun_command(tiny(nproc_per_node=4, nnodes="2", master_addr="10.0.0.1", node_rank=1), "c")
    assert "--master-addr" in cmd and cmd[cmd.index("--node-rank") + 1] == "1" and "29500" in cmd
    with pytest.raises(ConfigError, match="rdzv-endpoint"):
        torchrun_command(tiny(nnodes="2"), "c")


def test_config_checks() -> None:
    with pytest.raises(ConfigError, match="resume needs checkpoint_dir"):
        TrainConfig(resume=True)
    with pytest.raises(ConfigError, match="accum_steps"):
        TrainConfig(accum_steps=0)


# --------------------------------------------------------------------------- in-process runs


def test_synthetic_and_loader_only_produce_their_records(shards, tmp_path: Path) -> None:
    rec = train(tiny(mode="synthetic", steps=3), LOADER, World.single(), run_dir=tmp_path / "new" / "dir")
    m = rec.modes["synthetic"]
    assert list(rec.modes) == ["synthetic"] and m.num_steps == 3 and m.num_samples == 12
    assert m.samples_per_s > 0 and m.stall_pct == 0.0 and m.next_wait_s == 0.0 and m.compute_s > 0
    assert rec.verdict is None and rec.ok and rec.num_classes == 1000
    assert (tmp_path / "new" / "dir" / "summary.json").is_file()  # train() makes its run folder

    summary = launch(tiny(mode="loader-only", steps=4, shards=str(shards["train"]), run_dir=str(tmp_path / "run")),
                     LOADER)
    m = summary["modes"]["loader-only"]
    assert m["num_steps"] == 4 and m["num_samples"] == 16 and m["samples_per_s"] > 0 and m["compute_s"] == 0
    assert summary["verdict"] is None and summary["ok"]
    run = tmp_path / "run"
    for name in ("config.toml", "environment.json", "summary.json", "report.md", "log.jsonl", "throughput.png"):
        assert (run / name).is_file(), name
    assert "[loader]" in (run / "config.toml").read_text() and "[train]" in (run / "config.toml").read_text()
    assert len(read_log(run)) == 5 and read_log(run)[0]["mode"] == "loader-only"


def test_grad_accumulation_matches_the_large_batch_gradient() -> None:
    torch.manual_seed(123)
    x = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8)
    y = torch.randint(0, 10, (8,))
    grads = []
    for accum, chunks in ((1, [(x, y)]), (2, [(x[:4], y[:4]), (x[4:], y[4:])]), (4, list(zip(x.split(2), y.split(2))))):
        t = Trainer(tiny(mode="synthetic", steps=1, accum_steps=accum, num_classes=10, label_smoothing=0.1),
                    LOADER, World.single())
        t.module.eval()  # BatchNorm on running statistics: the only per-batch coupling goes away
        t.optimizer.zero_grad(set_to_none=True)
        for i, (xb, yb) in enumerate(chunks):
            t.forward_backward(xb, yb, last=i == len(chunks) - 1)
        grads.append(torch.cat([p.grad.flatten() for p in t.module.parameters()]))
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-6)
    assert torch.allclose(grads[0], grads[2], rtol=1e-4, atol=1e-6)


def test_bf16_and_fp16_autocast_run_on_cpu() -> None:
    t = Trainer(tiny(mode="synthetic", steps=1, amp="bf16", num_classes=10, batch_size=2), LOADER, World.single())
    x, y = t.synthetic_batch()
    with torch.no_grad(), t.autocast():
        from gpufeed.loader import normalize

        assert t.model(normalize(x)).dtype == torch.bfloat16
    assert not t.scaler.is_enabled()
    for amp in ("bf16", "fp16"):  # fp16 with a GradScaler
        rec = train(tiny(mode="synthetic", steps=1, timing_warmup_steps=0, amp=amp, num_classes=10, batch_size=2),
                    LOADER, World.single())
        assert rec.final_loss is not None and torch.isfinite(torch.tensor(rec.final_loss))


class Killed(Exception):
    pass


def test_resume_after_a_killed_run_continues_at_the_same_step_lr_and_state(shards, tmp_path: Path) -> None:
    cfg = tiny(shards=str(shards["train"]), steps=6, warmup_steps=2)  # 16 batches/epoch: one epoch
    ref = tmp_path / "ref"
    ref.mkdir()
    train(cfg, LOADER, World.single(), run_dir=ref)
    ref_log = {r["step"]: r for r in read_log(ref)}

    ck = tmp_path / "ck"

    def kill_at_3(step: int) -> None:
        if step == 3:
            raise Killed

    with pytest.raises(Killed):
        train(dataclasses.replace(cfg, checkpoint_dir=str(ck), checkpoint_every=2), LOADER, World.single(),
              on_step=kill_at_3)
    state = torch.load(ck / "last.pt", map_location="cpu", weights_only=False)
    assert state["step"] == 2 and state["loader_position"]["batches_consumed"] == 2

    # the resumed trainer holds the checkpoint's optimizer state
    t = Trainer(dataclasses.replace(cfg, checkpoint_dir=str(ck), resume=True), LOADER, World.single())
    t.load_checkpoint()
    assert t.step == 2 and t.optimizer.param_groups[0]["lr"] == pytest.approx(ref_log[3]["lr"])
    for k, s in state["optimizer"]["state"].items():
        assert torch.equal(t.optimizer.state_dict()["state"][k]["momentum_buffer"], s["momentum_buffer"])

    run = tmp_path / "resumed"
    run.mkdir()
    rec = train(dataclasses.replace(cfg, checkpoint_dir=str(ck), resume=True), LOADER, World.single(), run_dir=run)
    assert rec.start_step == 2 and rec.step == 6
    log = read_log(run)
    assert [r["step"] for r in log] == [3, 4, 5, 6]
    for r in log:
        assert r["lr"] == pytest.approx(ref_log[r["step"]]["lr"], rel=1e-12)
        assert r["loss"] == pytest.approx(ref_log[r["step"]]["loss"], rel=1e-4)
    assert torch.load(ck / "last.pt", map_location="cpu", weights_only=False)["step"] == 6


# --------------------------------------------------------------------------- DDP (2 gloo processes via torchrun)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ddp_uneven_shards_equal_steps_identical_weights_validation(shards, tmp_path: Path) -> None:
    run = tmp_path / "ddp"
    res = invoke(["train", "--shards", shards["uneven"], "--val-shards", shards["val"], "--arch", "resnet18",
                  "--image-size", "32", "--batch-size", "4", "--num-workers", "1", "--amp", "off", "--epochs", "2",
                  "--nproc-per-node", "2", "--device", "cpu", "--checkpoint-dir", tmp_path / "ck", "--log-every", "2",
                  "--run-dir", run, "--quiet", "--json"], expect=None)
    assert res.exit_code in (0, 1), res.stderr
    s = json.loads(res.stdout)
    assert s["world_size"] == 2 and s["backend"] == "gloo"
    assert s["step"] == s["total_steps"] == 16 and s["epoch"] == 2  # 64 samples / 2 ranks / 4 = 8 steps per epoch
    real = s["modes"]["real"]
    assert [r["rank"] for r in real["per_rank"]] == [0, 1]
    assert len({r["num_steps"] for r in real["per_rank"]}) == 1
    assert len(s["rank_param_checksums"]) == 2 and s["rank_param_checksums"][0] == s["rank_param_checksums"][1]
    assert [v["epoch"] for v in s["val"]] == [0, 1] and all(v["num_samples"] == 16 for v in s["val"])
    state = torch.load(tmp_path / "ck" / "last.pt", map_location="cpu", weights_only=False)
    assert state["step"] == 16 and len(state["rng"]) == 2
    assert (run / "summary.json").is_file() and (run / "report.md").is_file()
    assert read_log(run)[-1]["step"] == 16


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ddp_measure_runs_three_modes_and_ends_with_the_verdict(shards, tmp_path: Path) -> None:
    run = tmp_path / "measure"
    res = invoke(["train", "--shards", shards["train"], "--arch", "resnet18", "--image-size", "32",
                  "--batch-size", "4", "--num-workers", "0", "--amp", "off", "--measure", "--measure-steps", "3",
                  "--nproc-per-node", "2", "--device", "cpu", "--run-dir", run, "--quiet"], expect=None)
    s = json.loads((run / "summary.json").read_text())
    assert res.exit_code == (0 if s["ok"] else 1)
    assert list(s["modes"]) == ["synthetic", "loader-only", "real"]
    for m in s["modes"].values():
        assert m["num_ranks"] == 2 and m["num_steps"] == 3 and m["samples_per_s"] > 0
    assert s["verdict"]["status"] in ("fed", "starved")
    assert s["rank_param_checksums"][0] == s["rank_param_checksums"][1]
    assert res.stdout.strip().splitlines()[-1 - len(s["verdict"]["fixes"])].startswith("verdict: ")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_resume_after_sigkill(shards, tmp_path: Path) -> None:
    """A real kill: SIGKILL the CLI process once a checkpoint exists, then --resume finishes the run."""
    import os
    import signal
    import subprocess
    import sys
    import time

    ck = tmp_path / "ck"
    args = ["--shards", shards["train"], "--arch", "resnet18", "--image-size", "32", "--batch-size", "4",
            "--num-workers", "0", "--amp", "off", "--steps", "40", "--warmup-steps", "4", "--device", "cpu",
            "--checkpoint-dir", ck, "--checkpoint-every", "3", "--log-every", "1", "--quiet", "--threads", "1"]
    proc = subprocess.Popen([sys.executable, "-m", "gpufeed.cli", "train", *map(str, args), "--run-dir",
                             str(tmp_path / "killed")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (ck / "last.pt").exists():
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    saved = torch.load(ck / "last.pt", map_location="cpu", weights_only=False)["step"]
    assert saved % 3 == 0 and 3 <= saved < 40

    res = invoke(["train", *args, "--resume", "--run-dir", tmp_path / "resumed", "--json"], expect=None)
    s = json.loads(res.stdout)
    assert s["start_step"] == saved and s["step"] == 40
    log = read_log(tmp_path / "resumed")
    assert log[0]["step"] == saved + 1
    for r in log:  # the LR continues on the same warm-up + cosine schedule
        assert r["lr"] == pytest.approx(lr_at(r["step"] - 1, total=40, warmup=4, peak=0.1))


def test_timing_window_drains_the_worker_backlog() -> None:
    """W workers x P prefetched batches are ready before timing starts: they must fall in the warm-up."""
    from types import SimpleNamespace

    from gpufeed.config import LoaderConfig
    from gpufeed.train import Trainer

    t = SimpleNamespace(cfg=SimpleNamespace(timing_warmup_steps=3), loader=object(),
                        loader_cfg=LoaderConfig(num_workers=16, prefetch_factor=4), accum=1)
    assert Trainer.timing_window(t, "loader-only", 20) == (65, 32)
    assert Trainer.timing_window(t, "synthetic", 20) == (3, 20)
    t.accum = 2
    assert Trainer.timing_window(t, "real", 20) == (33, 20)
    t.loader_cfg = LoaderConfig(num_workers=0)
    assert Trainer.timing_window(t, "real", 20) == (3, 20)


def test_meter_leaves_paused_time_out_of_the_rate() -> None:
    import time

    from gpufeed.train import _Meter
    from gpufeed.world import World

    m = _Meter(0, 10, World.single())
    m.before_step()
    time.sleep(0.05)
    m.add(0.05, 0.0, 0.0, 0.05, 10)
    m.pause()
    time.sleep(0.3)  # e.g. validation
    m.resume()
    m.stop()
    time.sleep(0.2)  # e.g. logging and worker shutdown, after the window
    r = m.finish()
    assert r.wall_s < 0.2 and r.samples_per_s > 50
