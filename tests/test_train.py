from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from gpufeed.config import LoaderConfig, TrainConfig
from gpufeed.core.errors import ConfigError
from gpufeed.train.launch import launch, torchrun_command
from gpufeed.train import Trainer, lr_at, train
from gpufeed.core.world import World
from tests.common.cli import invoke
from tests.common.shards import sizes_as_found, write_tiny_shards

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


def _gpufeed_imports(path: Path) -> tuple[set[str], set[str]]:
    """(gpufeed modules imported at module level, imported anywhere) by the file at ``path``."""
    import ast

    tree = ast.parse(path.read_text())

    def names(nodes) -> set[str]:  # type: ignore[no-untyped-def]
        out = set()
        for n in nodes:
            if isinstance(n, ast.ImportFrom) and n.module:
                out.add(n.module)
            elif isinstance(n, ast.Import):
                out.update(a.name for a in n.names)
        return {m for m in out if m.startswith("gpufeed")}

    return names(tree.body), names(ast.walk(tree))


def test_the_trainer_and_the_planner_import_in_one_direction() -> None:
    """gpufeed.model is shared by train and plan, and imports neither; plan does not import the trainer; the
    checkpoint takes the loader's position type as a parameter (no loader import); no trainer module imports
    another job (tune, stage, shard) and storage only lazily (the probe, the io record)."""
    src = Path(__file__).resolve().parents[1] / "src" / "gpufeed"
    _, model = _gpufeed_imports(src / "model.py")
    assert not {m for m in model if m.startswith(("gpufeed.train", "gpufeed.memplan"))}
    _, plan = _gpufeed_imports(src / "memplan.py")
    assert "gpufeed.model" in plan and not {m for m in plan if m.startswith("gpufeed.train")}
    _, checkpoint = _gpufeed_imports(src / "train" / "checkpoint.py")
    assert not {m for m in checkpoint if m.startswith("gpufeed.loader")}
    for path in (src / "train").glob("*.py"):
        top, anywhere = _gpufeed_imports(path)
        assert not {m for m in anywhere if m.startswith(("gpufeed.tune", "gpufeed.stage", "gpufeed.shard."))} and \
            "gpufeed.shard" not in anywhere, path.name
        assert not {m for m in top if m.startswith("gpufeed.storage")}, path.name
        if path.name != "__init__.py":  # the package re-exports; its modules import each other, never the package
            assert "gpufeed.train" not in anywhere, path.name


def test_lr_warmup_then_cosine() -> None:
    lrs = [lr_at(s, total=10, warmup=2, peak=1.0) for s in range(10)]
    assert lrs[0] == pytest.approx(0.5) and lrs[1] == pytest.approx(1.0)
    assert lrs[2] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))
    assert lr_at(10, total=10, warmup=2, peak=1.0, floor=0.1) == pytest.approx(0.1)


def test_torchrun_command_rendezvous_options(tmp_path: Path) -> None:
    cmd = torchrun_command(tiny(nproc_per_node=2), tmp_path / "c.toml")
    assert cmd[1:4] == ["-m", "gpufeed.train", "--torchrun"] and "--standalone" in cmd
    assert cmd[-3:] == ["-m", "gpufeed.train", str(tmp_path / "c.toml")]
    cmd = torchrun_command(tiny(nproc_per_node=8, nnodes="2", rdzv_endpoint="node0:29400", rdzv_id="job7"), "c")
    assert ["--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:29400", "--rdzv-id", "job7"] == cmd[8:14]
    cmd = torchrun_command(tiny(nproc_per_node=4, nnodes="2", master_addr="10.0.0.1", node_rank=1), "c")
    assert "--master-addr" in cmd and cmd[cmd.index("--node-rank") + 1] == "1" and "29500" in cmd
    with pytest.raises(ConfigError, match="rdzv-endpoint"):
        torchrun_command(tiny(nnodes="2"), "c")


def test_the_note_of_a_node_without_rank_0_names_node_0() -> None:
    from gpufeed.train.launch import not_node_zero_note

    static = tiny(nproc_per_node=4, nnodes="2", master_addr="10.0.0.1", node_rank=1)
    assert not_node_zero_note(static) == ("this node (node rank 1) ran its ranks; the summary and verdict are in "
                                          "the run folder of node 0 (--node-rank 0)")
    c10d = tiny(nproc_per_node=8, nnodes="2", rdzv_endpoint="node0:29400")
    assert "torchrun numbers the nodes itself" in not_node_zero_note(c10d)


CADENCE = [  # (checkpoint_every, step, epoch end, run end) -> save?
    (0, 3, False, False, False),  # no count: only epoch and run ends
    (0, 3, True, False, True),
    (0, 3, False, True, True),
    (2, 4, False, False, True),  # on the count
    (2, 5, False, False, False),
    (2, 5, True, False, True),  # an epoch end off the count
    (2, 5, False, True, True),  # the run's end off the count
    (2, 6, True, True, True),  # all three at once: still one save
]


def test_checkpoint_cadence_is_one_rule(tmp_path: Path) -> None:
    for every in (0, 2):
        with_dir = Trainer(tiny(mode="synthetic", steps=1, num_classes=4, checkpoint_dir=str(tmp_path),
                                checkpoint_every=every), LOADER, World.single()).checkpointer
        without = Trainer(tiny(mode="synthetic", steps=1, num_classes=4, checkpoint_every=every), LOADER,
                          World.single()).checkpointer
        for e, step, epoch_end, run_end, save in CADENCE:
            if e == every:
                assert with_dir.should_save(step, epoch_end=epoch_end, run_end=run_end) is save, (e, step)
                assert without.should_save(step, epoch_end=epoch_end, run_end=run_end) is False  # no folder


def test_config_checks() -> None:
    with pytest.raises(ConfigError, match="resume needs checkpoint_dir"):
        TrainConfig(resume=True)
    with pytest.raises(ConfigError, match="accum_steps"):
        TrainConfig(accum_steps=0)
    with pytest.raises(ConfigError, match=r"give storage_bytes_per_s \(--storage-rate\) or storage_record, not both"):
        TrainConfig(storage_bytes_per_s=1e9, storage_record="io/summary.json")
    with pytest.raises(ConfigError, match="storage_probe_s"):
        TrainConfig(storage_probe_s=-1)


# --------------------------------------------------------------------------- in-process runs


def test_synthetic_and_loader_only_produce_their_records(shards, tmp_path: Path) -> None:
    rec = train(tiny(mode="synthetic", steps=3), LOADER, World.single(), run_dir=tmp_path / "new" / "dir")
    m = rec.modes["synthetic"]
    assert list(rec.modes) == ["synthetic"] and m.num_steps == 3 and m.num_samples == 12
    assert m.samples_per_s > 0 and m.stall_pct == 0.0 and m.next_wait_s == 0.0 and m.compute_s > 0
    assert rec.verdict is None and rec.ok and rec.num_classes == 1000
    assert (tmp_path / "new" / "dir" / "summary.json").is_file()  # train() makes its run folder
    assert rec.gpu_health == [] and not (tmp_path / "new" / "dir" / "gpu_health.jsonl").exists()  # CPU: no NVML GPU
    assert "\nGPU health: not sampled (no NVML GPU)\n" in (tmp_path / "new" / "dir" / "report.md").read_text()

    summary = launch(tiny(mode="loader-only", steps=4, shards=str(shards["train"]), run_dir=str(tmp_path / "run")),
                     LOADER)
    m = summary["modes"]["loader-only"]
    assert m["num_steps"] == 4 and m["num_samples"] == 16 and m["samples_per_s"] > 0 and m["compute_s"] == 0
    assert summary["verdict"] is None and summary["ok"]
    run = tmp_path / "run"
    for name in ("config.toml", "environment.json", "summary.json", "report.md", "log.jsonl", "throughput.png"):
        assert (run / name).is_file(), name
    assert "[loader]" in (run / "config.toml").read_text() and "[train]" in (run / "config.toml").read_text()
    # loader-only is measured by the harness tune uses: one record per timed window (4 windows of log_every = 1)
    assert len(read_log(run)) == 4 and read_log(run)[0]["mode"] == "loader-only"


def test_grad_accumulation_matches_the_large_batch_gradient() -> None:
    torch.manual_seed(123)
    x = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8)
    y = torch.randint(0, 10, (8,))
    grads = []
    for accum, chunks in ((1, [(x, y)]), (2, [(x[:4], y[:4]), (x[4:], y[4:])]), (4, list(zip(x.split(2), y.split(2))))):
        t = Trainer(tiny(mode="synthetic", steps=1, accum_steps=accum, num_classes=10, label_smoothing=0.1),
                    LOADER, World.single())
        t.model.module.eval()  # BatchNorm on running statistics: the only per-batch coupling goes away
        t.optimizer.zero_grad(set_to_none=True)
        for i, (xb, yb) in enumerate(chunks):
            t.compute.forward_backward(xb, yb, last=i == len(chunks) - 1)
        grads.append(torch.cat([p.grad.flatten() for p in t.model.module.parameters()]))
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-6)
    assert torch.allclose(grads[0], grads[2], rtol=1e-4, atol=1e-6)


def test_bf16_and_fp16_autocast_run_on_cpu() -> None:
    t = Trainer(tiny(mode="synthetic", steps=1, amp="bf16", num_classes=10, batch_size=2), LOADER, World.single())
    x, y = t.synthetic_step.batch()
    with torch.no_grad(), t.amp.autocast():
        from gpufeed.loader import normalize

        assert t.model.forward(normalize(x)).dtype == torch.bfloat16
    assert not t.amp.scaler.is_enabled()
    for amp in ("bf16", "fp16"):  # fp16 with a GradScaler
        rec = train(tiny(mode="synthetic", steps=1, timing_warmup_steps=0, amp=amp, num_classes=10, batch_size=2),
                    LOADER, World.single())
        assert rec.final_loss is not None and torch.isfinite(torch.tensor(rec.final_loss))


class Killed(Exception):
    pass


def test_resume_after_a_killed_run_continues_at_the_same_step_lr_and_state(shards, tmp_path: Path,
                                                                          monkeypatch) -> None:
    cfg = tiny(shards=str(shards["train"]), steps=6, warmup_steps=2)  # 16 batches/epoch: one epoch
    ref = tmp_path / "ref"
    ref.mkdir()
    train(dataclasses.replace(cfg, checkpoint_dir=str(tmp_path / "ref-ck")), LOADER, World.single(), run_dir=ref)
    ref_log = {r["step"]: r for r in read_log(ref)}

    ck = tmp_path / "ck"

    def kill_at_3(step: int) -> None:
        if step == 3:
            raise Killed

    with pytest.raises(Killed):
        train(dataclasses.replace(cfg, checkpoint_dir=str(ck), checkpoint_every=2), LOADER, World.single(),
              on_step=kill_at_3)
    state = torch.load(ck / "last.pt", map_location="cpu", weights_only=True)
    assert state["step"] == 2 and state["loader_position"]["batches_consumed"] == 2

    # the resumed trainer holds the checkpoint's optimizer state
    t = Trainer(dataclasses.replace(cfg, checkpoint_dir=str(ck), resume=True), LOADER, World.single())
    t.load_checkpoint()
    assert t.step == 2 and t.optimizer.param_groups[0]["lr"] == pytest.approx(ref_log[3]["lr"])
    for k, s in state["optimizer"]["state"].items():
        assert torch.equal(t.optimizer.state_dict()["state"][k]["momentum_buffer"], s["momentum_buffer"])

    run = tmp_path / "resumed"
    run.mkdir()
    import gpufeed.loader.decode as dec

    decoded = []
    real_decode = dec.decode_into
    monkeypatch.setattr(dec, "decode_into", lambda *a, **k: (decoded.append(1), real_decode(*a, **k))[1])
    rec = train(dataclasses.replace(cfg, checkpoint_dir=str(ck), resume=True), LOADER, World.single(), run_dir=run)
    assert rec.start_step == 2 and rec.step == 6
    # the 2 batches trained on before the checkpoint are passed over, not decoded again (no replay)
    assert len(decoded) == (6 - 2) * LOADER.batch_size
    log = read_log(run)
    assert [r["step"] for r in log] == [3, 4, 5, 6]
    for r in log:
        assert r["lr"] == ref_log[r["step"]]["lr"]
        assert r["loss"] == ref_log[r["step"]]["loss"]
    # bit for bit: the resumed run ends with the uninterrupted run's weights and momentum buffers
    end = torch.load(ck / "last.pt", map_location="cpu", weights_only=True)
    ref_end = torch.load(tmp_path / "ref-ck" / "last.pt", map_location="cpu", weights_only=True)
    assert end["step"] == ref_end["step"] == 6
    assert end["model"].keys() == ref_end["model"].keys()
    assert all(torch.equal(v, ref_end["model"][k]) for k, v in end["model"].items())
    assert all(torch.equal(v["momentum_buffer"], ref_end["optimizer"]["state"][k]["momentum_buffer"])
               for k, v in end["optimizer"]["state"].items())


# --------------------------------------------------------------------------- DDP (2 gloo processes via torchrun)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ddp_uneven_shards_equal_steps_identical_weights_validation(shards, tmp_path: Path) -> None:
    run = tmp_path / "ddp"
    res = invoke(["train", "--shards", shards["uneven"], "--val-shards", shards["val"], "--arch", "resnet18",
                  "--image-size", "32", "--batch-size", "4", "--num-workers", "1", "--amp", "off", "--epochs", "2",
                  "--nproc-per-node", "2", "--device", "cpu", "--checkpoint-dir", tmp_path / "ck", "--log-every", "2",
                  "--run-dir", run, "--quiet", "--json"], expect=None)
    s = json.loads(res.stdout)
    assert res.exit_code == (0 if s["ok"] else 1), res.stderr
    assert s["world_size"] == 2 and s["backend"] == "gloo"
    assert s["step"] == s["total_steps"] == 16 and s["epoch"] == 2  # 64 samples / 2 ranks / 4 = 8 steps per epoch
    real = s["modes"]["real"]
    assert [r["rank"] for r in real["per_rank"]] == [0, 1]
    assert len({r["num_steps"] for r in real["per_rank"]}) == 1
    assert len(s["rank_param_checksums"]) == 2 and s["rank_param_checksums"][0] == s["rank_param_checksums"][1]
    assert [v["epoch"] for v in s["val"]] == [0, 1] and all(v["num_samples"] == 16 for v in s["val"])
    state = torch.load(tmp_path / "ck" / "last.pt", map_location="cpu", weights_only=True)
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
    for m in s["modes"].values():  # at least the steps asked for: --measure goes on until its windows settle
        assert m["num_ranks"] == 2 and m["num_steps"] >= 3 and m["samples_per_s"] > 0 and m["other_cores"] >= 0
    # the verdict follows its rules from the recorded numbers (fed: stall < 5 % and >= 0.9 x the lower ceiling);
    # a disturbed or noisy measurement is inconclusive, never fed
    real, ceiling = s["modes"]["real"], min(s["modes"]["synthetic"]["samples_per_s"],
                                            s["modes"]["loader-only"]["samples_per_s"])
    fed = real["stall_pct"] < 5.0 and 0.9 * ceiling <= real["samples_per_s"] <= ceiling / 0.9
    assert s["verdict"]["status"] == "inconclusive" or (s["verdict"]["status"] == "fed") == fed
    assert s["ok"] == (s["verdict"]["status"] == "fed")
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
    saved = torch.load(ck / "last.pt", map_location="cpu", weights_only=True)["step"]
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
    from gpufeed.train import timing_window

    run = dict(warmup_steps=3, num_workers=16, prefetch_factor=4, has_loader=True)
    assert timing_window("loader-only", 20, accum=1, **run) == (65, 32)
    assert timing_window("synthetic", 20, accum=1, **run) == (3, 20)
    assert timing_window("real", 20, accum=2, **run) == (33, 20)
    assert timing_window("real", 20, accum=2, **{**run, "has_loader": False}) == (3, 20)  # no loader: no backlog
    assert timing_window("real", 20, accum=2, **{**run, "num_workers": 0, "prefetch_factor": 2}) == (3, 20)


def test_meter_leaves_paused_time_out_of_the_rate() -> None:
    from gpufeed.measure.timing import HostClock, Meter, StepMarks
    from gpufeed.core.world import World

    now = [0.0]
    clock = HostClock(now=iter([0.0, 0.05]).__next__)
    m = Meter(0, 10, World.single(), clock, wall=lambda: now[0])
    m.before_step()
    now[0] += 0.05  # one step of 10 samples
    m.add(StepMarks(clock).begin().finish(10))
    m.pause()
    now[0] += 0.3  # e.g. validation
    m.resume()
    m.stop()
    now[0] += 0.2  # e.g. logging and worker shutdown, after the window
    r = m.finish()
    assert r.wall_s == pytest.approx(0.05) and r.samples_per_s == pytest.approx(200.0)


# --------------------------------------------------------------------------- the world each rank sees


@pytest.mark.parametrize("env, device, expected", [
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, "cuda:0", "cuda:1"),
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, "cuda", "cuda:1"),
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, "auto", "cuda:1"),
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, "cpu", "cpu"),
    ({}, "cuda:3", "cuda:3"),  # one process keeps the GPU it was given
])
def test_world_from_env_puts_each_rank_on_its_local_gpu(monkeypatch, env, device, expected) -> None:
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    w = World.from_env(device)
    assert w.device == expected and w.backend == ("gloo" if expected == "cpu" else "nccl")
    if env:
        assert (w.rank, w.world_size, w.local_rank, w.local_world_size, w.num_nodes) == (3, 4, 1, 2, 2)
    else:
        assert (w.rank, w.world_size, w.local_world_size, w.num_nodes) == (0, 1, 1, 1)


def test_world_from_env_takes_the_node_from_torchrun(monkeypatch) -> None:
    """Node 1 of 2 with 1 rank, node 0 with 2 (3 ranks): the node counts come from torchrun's GROUP_* variables,
    not from world size / ranks per node (3 // 1 = 3 nodes)."""
    env = {"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "1",
           "GROUP_WORLD_SIZE": "2"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    w = World.from_env("cpu")
    assert (w.rank, w.node_rank, w.num_nodes, w.local_world_size) == (2, 1, 2, 1)
    monkeypatch.delenv("GROUP_WORLD_SIZE")  # an older launcher: counted from the ranks per node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert World.from_env("cpu").num_nodes == 1


def test_per_node_records_sum_each_nodes_ranks_and_show_in_the_report() -> None:
    """4 ranks on 2 nodes; node 1's rank 3 waits for data: its node's stall shows what the mean hides."""
    from gpufeed.core.records import to_jsonable
    from gpufeed.train.records import RankTiming, aggregate
    from gpufeed.train.report import render, render_markdown

    def rank(r: int, node: int, wait: float, cores: float) -> RankTiming:
        return RankTiming(rank=r, num_steps=10, num_samples=100, wall_s=2.0 + wait, step_s=2.0 + wait,
                          data_wait_s=wait, next_wait_s=wait, h2d_s=0.0, compute_s=2.0, samples_per_s=0.0,
                          stall_pct=0.0, window_rates=[50.0], cores_used=cores, read_bytes=1000, node=node,
                          host=f"host{node}")

    m = aggregate("real", [rank(3, 1, 2.0, 1.5), rank(0, 0, 0.0, 1.0), rank(1, 0, 0.0, 1.0), rank(2, 1, 0.0, 1.5)],
                  num_nodes=2)
    assert [(n.node, n.host, n.ranks) for n in m.per_node] == [(0, "host0", [0, 1]), (1, "host1", [2, 3])]
    assert [n.num_samples for n in m.per_node] == [200, 200]
    assert [n.samples_per_s for n in m.per_node] == [100.0, 50.0]  # 200 samples over the node's longest window
    assert [n.stall_pct for n in m.per_node] == [0.0, pytest.approx(100 * 2.0 / 6.0)]
    assert [n.loader_cores_used for n in m.per_node] == [2.0, 3.0]
    assert [n.read_bytes_per_s for n in m.per_node] == [1000.0, 500.0]
    s = {"mode": "real", "arch": "resnet18", "device": "cuda:0", "backend": "nccl", "world_size": 4, "num_nodes": 2,
         "amp": "bf16", "batch_size": 10, "accum_steps": 1, "global_batch": 40, "image_size": 224, "start_step": 0,
         "step": 10, "total_steps": 10, "epoch": 0, "final_loss": 1.0, "final_lr": 0.1, "started": "t",
         "wall_s": 5.0, "modes": {"real": to_jsonable(m)}}
    text = render(s)
    assert text.splitlines()[0].startswith("gpufeed train: resnet18 on 4 x cuda over 2 nodes (nccl)")
    assert ("  per node: node 0 (ranks 0-1) 100.0 samples/s, stall 0.0 %; "
            "node 1 (ranks 2-3) 50.0 samples/s, stall 33.3 %") in text.splitlines()
    md = render_markdown(s)
    assert md.startswith("# gpufeed train — resnet18, 4 x cuda over 2 nodes, mode real")
    assert "| 1 | host1 | 2-3 | 50.0 | 33.3 | 3.0 |" in md.splitlines()


# --------------------------------------------------------------------------- a checkpoint that does not fit


TINY_ARGS = ["--arch", "resnet18", "--image-size", "32", "--num-workers", "0", "--amp", "off", "--device", "cpu",
             "--quiet", "--threads", "1"]
"""A cheap CPU run, without --steps and --batch-size."""


@pytest.fixture(scope="module")
def checkpoint(shards, tmp_path_factory) -> Path:
    """A real last.pt of a 1-step resnet18 run on shards['train']."""
    ck = tmp_path_factory.mktemp("ck")
    invoke(["train", "--shards", shards["train"], *TINY_ARGS, "--steps", "1", "--batch-size", "4",
            "--checkpoint-dir", ck, "--run-dir", tmp_path_factory.mktemp("run")],
           expect=None)  # exit 1 when the verdict says starved
    assert (ck / "last.pt").is_file()
    return ck / "last.pt"


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif how == "junk":
        path.write_bytes(b"not a checkpoint\n")
    elif how == "record":  # a valid zip archive whose first tensor record is cut short
        import io
        import zipfile

        src = zipfile.ZipFile(io.BytesIO(data))
        with zipfile.ZipFile(path, "w") as out:
            for name in src.namelist():
                out.writestr(name, src.read(name)[:2] if name.endswith("/data/0") else src.read(name))
    elif how == "fc":
        state = torch.load(path, map_location="cpu", weights_only=True)
        state["model"]["fc.weight"] = torch.zeros(3, 512)
        torch.save(state, path)


@pytest.mark.parametrize("damage, args, says", [
    ("none", ["--arch", "resnet34"], "was written for arch 'resnet18', this run trains 'resnet34'"),
    ("truncate", [], "is not a gpufeed checkpoint: not a torch zip archive (truncated"),
    ("junk", [], "is not a gpufeed checkpoint: not a torch zip archive"),
    ("record", [], "cannot be read: truncated or corrupt (RuntimeError: record size"),
    ("fc", [], "model['fc.weight'] is torch.float32 (3, 512), this run has torch.float32 (4, 512)"),
])
def test_resume_refuses_a_checkpoint_that_does_not_fit(shards, checkpoint, tmp_path: Path, damage, args,
                                                        says) -> None:
    ck = tmp_path / "ck"
    ck.mkdir()
    path = ck / "last.pt"
    path.write_bytes(checkpoint.read_bytes())
    _damage(path, damage)
    res = invoke(["train", "--shards", shards["train"], *TINY_ARGS, "--steps", "1", "--batch-size", "4", *args,
                  "--checkpoint-dir", ck, "--resume", "--run-dir", tmp_path / "run"], expect=2)
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and says in err[0], res.stderr
    assert "Traceback" not in res.stderr


def test_resume_checks_the_checkpoint_before_loading_it(checkpoint, tmp_path: Path) -> None:
    """The checks, one by one, on the Trainer (no CLI): each one is a DataError naming the file."""
    from gpufeed.core.errors import DataError

    ck = tmp_path / "ck"
    ck.mkdir()
    cfg = tiny(mode="synthetic", steps=1, num_classes=4, checkpoint_dir=str(ck), resume=True)
    good = torch.load(checkpoint, map_location="cpu", weights_only=True)
    cases = [
        ({"version": 1}, "checkpoint version 1"),
        ({"num_classes": 10}, "10 classes, this run has 4"),
        ({"step": -1}, "step is -1"),
        ({"rng": []}, "RNG states"),
        ({"rng": [{**good["rng"][0], "torch": torch.zeros(3, dtype=torch.uint8)}]}, "torch RNG state is malformed"),
        ({"rng": [{**good["rng"][0], "python": {"version": 3, "key": torch.zeros(3, dtype=torch.int64),
                                                 "gauss": None}}]}, "Python RNG state is malformed"),
        ({"optimizer": {**good["optimizer"], "state": {0: {"momentum_buffer": torch.zeros(2)}}}},
         "optimizer state[0]"),
        ({"optimizer": {**good["optimizer"], "param_groups": [{**g, "lr": "0.1"} for g in
                                                                good["optimizer"]["param_groups"]]}},
         "not a finite number"),
        ({"loader_position": {"epoch": 0, "batches_consumed": 99}}, "does not match epoch"),
        ({"loader_position": {"epoch": -1, "batches_consumed": 1}}, "epoch must be a non-negative integer"),
        ({"step_in_epoch": 10**6, "loader_position": {"epoch": 0, "batches_consumed": 10**6}},
         "beyond this run's"),
    ]
    for change, says in cases:
        torch.save({**good, **change}, ck / "last.pt")
        t = Trainer(cfg, LOADER, World.single())
        with pytest.raises(DataError, match="last.pt") as info:
            t.load_checkpoint()
        assert says in str(info.value), (change.keys(), str(info.value))
        assert t.step == 0  # nothing was applied
    torch.save(good, ck / "last.pt")
    t = Trainer(cfg, LOADER, World.single())
    assert t.load_checkpoint() is not None and t.step == 1 and t.resume_rng is not None


# --------------------------------------------------------------------------- failures: exit codes and one sentence


@pytest.fixture(scope="module")
def truncated(tmp_path_factory) -> Path:
    """shards['train']'s layout with train-000001.tar cut in half, its size as found recorded in the manifest, so
    that the damage is met mid-run by the reader (a size the manifest does not say is refused before the run:
    tests/test_attacks_round3.py)."""
    dest = write_tiny_shards(tmp_path_factory.mktemp("truncated") / "set", [16, 16, 16, 16])
    shard = dest / "train-000001.tar"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    sizes_as_found(dest)
    return dest


def test_a_shard_failing_mid_run_is_a_run_error_exit_1(truncated, tmp_path: Path) -> None:
    res = invoke(["train", "--shards", truncated, *TINY_ARGS, "--steps", "16", "--batch-size", "4",
                  "--run-dir", tmp_path / "run"], expect=1)
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and "train-000001.tar" in err[0], res.stderr


def test_too_few_samples_per_rank_is_refused_before_launch(shards, tmp_path: Path) -> None:
    """64 samples, 2 ranks, batch 64: no batch per rank. Found before torchrun starts: exit 2, no run folder."""
    run = tmp_path / "run"
    res = invoke(["train", "--shards", shards["train"], *TINY_ARGS, "--steps", "1", "--batch-size", "64",
                  "--nproc-per-node", "2", "--run-dir", run], expect=2)
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and "64 samples are not enough for one batch of 64 on each of 2 rank" in err[0], res.stderr
    assert not run.exists()


def test_a_missing_shard_is_exit_2_before_any_rank_starts(shards, tmp_path: Path) -> None:
    import shutil

    dest = tmp_path / "set"
    shutil.copytree(shards["train"], dest)
    (dest / "train-000002.tar").unlink()
    for extra in ([], ["--nproc-per-node", "2"]):
        res = invoke(["train", "--shards", dest, *TINY_ARGS, "--steps", "1", "--batch-size", "4", *extra,
                      "--run-dir", tmp_path / "run"], expect=2)
        err = res.stderr.strip().splitlines()
        assert len(err) == 1 and "train-000002.tar" in err[0] and "missing" in err[0], res.stderr


def test_rank_failure_reports_the_first_cause_with_its_exit_code(tmp_path: Path) -> None:
    from gpufeed.core.errors import GpufeedError, RunError
    from gpufeed.train.launch import rank_failure

    def report(rank: int, message: str, code: int, cause: bool, t: float) -> None:
        (tmp_path / f"rank-{rank}.error").write_text(json.dumps(
            {"rank": rank, "message": message, "exit_code": code, "cause": cause, "time": t}))

    err = rank_failure(tmp_path, 1)
    assert isinstance(err, RunError) and "no rank reported a cause" in str(err)
    report(0, "unexpected RuntimeError: Connection closed by peer", 1, False, 10.0)  # the consequence, first
    report(1, "shard /x/train-000001.tar: truncated", 1, True, 11.0)
    report(2, "shard /x/train-000003.tar: truncated", 1, True, 12.0)
    (tmp_path / "rank-3.error").write_text("{half a record")  # ignored
    err = rank_failure(tmp_path, 1)
    assert isinstance(err, RunError) and str(err) == "rank 1: shard /x/train-000001.tar: truncated"
    report(1, "/ck/last.pt was written for arch 'resnet50', this run trains 'resnet18'", 2, True, 11.0)
    err = rank_failure(tmp_path, 1)
    assert not isinstance(err, RunError) and isinstance(err, GpufeedError) and err.exit_code == 2
    assert str(err).startswith("rank 1: /ck/last.pt")


def test_rank_failure_on_a_node_without_the_cause_points_to_the_other_nodes(tmp_path: Path) -> None:
    """Each node's launcher reads only its own ranks' files: a peer's death is all this node saw."""
    from gpufeed.core.errors import RunError
    from gpufeed.train.launch import rank_failure

    (tmp_path / "rank-0.error").write_text(json.dumps(
        {"rank": 0, "message": "unexpected RuntimeError: Connection closed by peer", "exit_code": 1, "cause": False,
         "time": 1.0}))
    assert str(rank_failure(tmp_path, 1)) == "rank 0: unexpected RuntimeError: Connection closed by peer"
    err = rank_failure(tmp_path, 1, multi_node=True)
    assert isinstance(err, RunError) and str(err) == ("rank 0: unexpected RuntimeError: Connection closed by peer "
                                                      "(no rank of this node named a cause: see the other nodes' "
                                                      "output)")


def test_rank_entry_point_prints_one_sentence_and_writes_its_cause(shards, tmp_path: Path, capsys) -> None:
    """What each rank does under torchrun, in this process: a refused checkpoint (before the first step) -> 2."""
    from gpufeed.config import to_toml
    from gpufeed.train.launch import main

    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "last.pt").write_bytes(b"junk")
    cfg = tiny(shards=str(shards["train"]), steps=1, checkpoint_dir=str(ck), resume=True, run_dir=str(tmp_path))
    (tmp_path / "config.toml").write_text(to_toml("loader", LOADER) + "\n" + to_toml("train", cfg))
    assert main([str(tmp_path / "config.toml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"rank 0: {ck / 'last.pt'} is not a gpufeed checkpoint: not a torch zip archive (truncated, "
                   f"junk or an old torch format)"]
    report = json.loads((tmp_path / "rank-0.error").read_text())
    assert report["rank"] == 0 and report["exit_code"] == 2 and report["cause"] is True
    assert report["message"] == err[0].removeprefix("rank 0: ")


def test_rank_entry_point_shows_a_traceback_only_when_verbose(tmp_path: Path, capsys, monkeypatch) -> None:
    import gpufeed.train.launch as launch_module
    from gpufeed.config import to_toml

    def crash(*args, **kwargs):
        raise RuntimeError("Connection closed by peer\nmore detail")

    monkeypatch.setattr(launch_module, "train", crash)
    (tmp_path / "config.toml").write_text(to_toml("train", tiny(mode="synthetic", steps=1)))
    monkeypatch.delenv("GPUFEED_VERBOSE", raising=False)
    assert launch_module.main([str(tmp_path / "config.toml")]) == 1
    assert capsys.readouterr().err == "rank 0: unexpected RuntimeError: Connection closed by peer\n"
    assert json.loads((tmp_path / "rank-0.error").read_text())["cause"] is False
    monkeypatch.setenv("GPUFEED_VERBOSE", "1")
    assert launch_module.main([str(tmp_path / "config.toml")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and err.endswith("rank 0: unexpected RuntimeError: Connection closed by peer\n")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ddp_rank_failure_ends_in_one_sentence_naming_the_shard(truncated, tmp_path: Path) -> None:
    """2 gloo ranks, one meets a truncated shard mid-epoch: exit 1, no traceback, the cause on the last line."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "gpufeed.cli", "train", "--shards", str(truncated), *TINY_ARGS, "--steps", "8",
         "--batch-size", "4", "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=200)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr and len(lines) <= 4, proc.stderr
    assert lines[-1].startswith("error: rank ") and "train-000001.tar" in lines[-1], proc.stderr


# --------------------------------------------------------------------------- amp auto, the chart


def test_amp_auto_resolves_per_device(monkeypatch) -> None:
    from gpufeed.train import resolve_amp

    assert TrainConfig().amp == "auto"
    assert resolve_amp("auto", torch.device("cpu")) == ("off", "amp auto -> off (CPU)")
    assert resolve_amp("bf16", torch.device("cpu")) == ("bf16", None)  # what the user asked for stands
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    assert resolve_amp("auto", torch.device("cuda:0")) == (
        "fp16", "amp auto -> fp16 with a GradScaler (compute capability 7.0 has no native bf16)")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_amp("auto", torch.device("cuda:0")) == ("bf16", "amp auto -> bf16 (compute capability 9.0)")


def test_amp_auto_on_cpu_trains_in_float32_and_says_so(tmp_path: Path) -> None:
    from gpufeed.train.report import render

    cfg = tiny(mode="synthetic", steps=1, timing_warmup_steps=0, amp="auto", num_classes=4, batch_size=2,
               image_size=16)
    rec = train(cfg, LOADER, World.single(), run_dir=tmp_path)
    assert rec.amp == "off" and "amp auto -> off (CPU)" in rec.notes
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["amp"] == "off"
    text = render(s)
    assert ", amp off," in text and "note: amp auto -> off (CPU)" in text
    assert "ceilings: compute ceiling (CPU) " in text and "GPU" not in text


def _summary(device: str, rates: dict[str, float], stalls: list[float], verdict: dict | None = None) -> dict:
    modes = {k: {"samples_per_s": v, "per_rank": [{"rank": i, "stall_pct": p} for i, p in enumerate(stalls)]}
             for k, v in rates.items()}
    return {"device": device, "modes": modes, "verdict": verdict}


def test_chart_data_puts_the_rates_side_by_side_and_the_stall_per_rank() -> None:
    from gpufeed.train.report import chart_data

    s = _summary("cpu", {"synthetic": 3.0, "loader-only": 1500.0, "real": 2.9}, [1.0, 7.5])
    d = chart_data(s)
    assert d["rates"] == [("synthetic", "compute ceiling (CPU)", 3.0), ("loader-only", "loader ceiling", 1500.0),
                          ("real", "end to end", 2.9)]
    assert d["log_scale"] is True  # 1500 / 2.9 > 20: on a linear axis the compute rates would vanish
    assert d["stall_mode"] == "real" and d["stalls"] == [(0, 1.0), (1, 7.5)]
    d = chart_data(_summary("cuda:0", {"synthetic": 3000.0, "loader-only": 4000.0, "real": 2900.0}, [2.0]))
    assert d["rates"][0] == ("synthetic", "GPU ceiling", 3000.0) and d["log_scale"] is False
    d = chart_data(_summary("cpu", {"loader-only": 100.0}, [0.0]))
    assert d["stall_mode"] is None and d["stalls"] == []  # the loader alone has no stall


def test_plot_summary_writes_the_png(tmp_path: Path) -> None:
    from gpufeed.train.report import plot_summary

    s = _summary("cpu", {"synthetic": 3.0, "loader-only": 1500.0, "real": 2.9}, [1.0, 7.5],
                 {"status": "starved", "bound": "rank imbalance"})
    assert plot_summary(tmp_path, s) == "throughput.png"
    assert (tmp_path / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_summary(tmp_path / "none", _summary("cpu", {}, [])) is None


def test_class_lists_must_fit_the_model_and_agree_with_validation(shards, tmp_path: Path) -> None:
    """num_classes below the set's class count would put labels out of range mid-run; a validation set with
    another class list would score top-1 against the wrong names. Both are refused before launch (exit 2)."""
    import json as _json
    import shutil

    from tests.common.cli import invoke

    args = ["train", "--arch", "resnet18", "--image-size", "32", "--batch-size", "4", "--num-workers", "0",
            "--amp", "off", "--steps", "1", "--device", "cpu", "--quiet"]
    cfg = tmp_path / "c.toml"
    cfg.write_text("[train]\nnum_classes = 2\n")
    res = invoke([*args, "--shards", shards["train"], "--config", cfg, "--run-dir", tmp_path / "a"], expect=2)
    assert "num_classes = 2 is fewer than the 4 classes of" in res.stderr
    val = tmp_path / "val"
    shutil.copytree(shards["val"], val)
    m = _json.loads((val / "manifest.json").read_text())
    m["classes"] = list(reversed(m["classes"]))
    (val / "manifest.json").write_text(_json.dumps(m))
    res = invoke([*args, "--shards", shards["train"], "--val-shards", val, "--run-dir", tmp_path / "b"], expect=2)
    assert "validation labels would not mean the training classes" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_a_full_disk_while_checkpointing_is_a_failed_run_exit_1(shards, tmp_path: Path, monkeypatch) -> None:
    import errno

    import gpufeed.train.checkpoint as ck

    from tests.common.cli import invoke

    def full(obj, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(ck, "_atomic_torch_save", full)
    res = invoke(["train", "--shards", shards["train"], "--arch", "resnet18", "--image-size", "32",
                  "--batch-size", "4", "--num-workers", "0", "--amp", "off", "--steps", "1", "--device", "cpu",
                  "--quiet", "--checkpoint-dir", tmp_path / "ck", "--run-dir", tmp_path / "run"], expect=1)
    assert res.stderr.strip().splitlines()[-1] == f"error: No space left on device ({tmp_path / 'ck' / 'last.pt'})"
