"""Signals, launch environments, rendezvous bounds and checkpoint write failures (issue 16, signals slice).

- SIGTERM to the launcher of a 2-rank run reaches torchrun and the ranks; nothing is left running.
- SIGTERM to a 1-process run: a checkpoint at the next step boundary, one sentence, exit 143, an exact resume.
- An inconsistent launch environment is refused before any rendezvous; a rendezvous a rank never joins ends
  within its bound, naming the rank.
- A checkpoint write on a full disk, or interrupted by SIGINT, is one sentence (never torch's RuntimeError);
  a temporary left by a killed write is removed by the next write.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gpufeed.config import LoaderConfig, TrainConfig
from gpufeed.core.errors import ConfigError, RunError
from gpufeed.core.world import World, check_launch_env, join
from tests.common.cli import invoke, kill_tree
from tests.common.netserver import closed_port
from tests.common.shards import write_tiny_shards

LOADER = LoaderConfig(batch_size=4, num_workers=0, image_size=32, shuffle_buffer=16, decode="pil", pin_memory=False)
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "GROUP_RANK", "GROUP_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE", "GPUFEED_RENDEZVOUS_TIMEOUT_S")


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return write_tiny_shards(tmp_path_factory.mktemp("signal-shards") / "train", [16, 16, 16, 16])


@pytest.fixture
def clean_env(monkeypatch):
    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def train_args(shards: Path, *extra: object) -> list[str]:
    return [str(a) for a in ["train", "--shards", shards, "--arch", "resnet18", "--image-size", "32",
                             "--batch-size", "4", "--num-workers", "0", "--amp", "off", "--device", "cpu",
                             "--log-every", "1", "--quiet", "--threads", "1", *extra]]


def alive(processes: list) -> list:
    """The processes of ``processes`` still running (zombies waiting for their new parent do not count)."""
    import psutil

    out = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


# --------------------------------------------------------------------------- the launcher of a 2-rank run


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigterm_to_the_launcher_stops_torchrun_and_both_ranks(shards, tmp_path: Path, clean_env) -> None:
    import psutil

    run, ck = tmp_path / "run", tmp_path / "ck"
    args = train_args(shards, "--nproc-per-node", "2", "--steps", "400", "--checkpoint-dir", ck, "--run-dir", run)
    proc = subprocess.Popen([sys.executable, "-m", "gpufeed.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    family: list = []
    try:
        deadline = time.monotonic() + 150
        while not ((run / "log.jsonl").exists() and (run / "log.jsonl").read_text().count("\n") >= 2):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the ranks did not start training"
            time.sleep(0.1)
        family = psutil.Process(proc.pid).children(recursive=True)
        assert len([p for p in family if "gpufeed.train" in " ".join(p.cmdline())]) >= 3  # torchrun + 2 ranks
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=90)
        deadline = time.monotonic() + 10
        while alive(family) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p.cmdline() for p in alive(family)]
    finally:
        kill_tree(proc)
        for p in alive(family):  # without the fix they outlive the launcher: do not leave them training
            p.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1].startswith("error: interrupted by SIGTERM; the ranks stopped after step "), err
    assert "Traceback" not in err and "RuntimeError" not in err
    assert not left, left  # no torchrun, no rank, no loader worker outlives the launcher
    assert not (run / "summary.json").exists()  # no record claims a finished run
    # both ranks stopped after the same step, and rank 0 saved it
    state = torch.load(ck / "last.pt", map_location="cpu", weights_only=True)
    assert 1 <= state["step"] < 400 and len(state["rng"]) == 2
    assert f"checkpoint at step {state['step']}" in err.strip().splitlines()[-1]


# --------------------------------------------------------------------------- a 1-process run


def tiny(**kw) -> TrainConfig:
    base = dict(arch="resnet18", amp="off", progress=False, log_every=1, timing_warmup_steps=1, device="cpu",
                lr=0.05, threads=1)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.timeout(240)
def test_sigterm_to_one_process_checkpoints_at_the_step_boundary_and_resumes_exactly(shards, tmp_path: Path,
                                                                                     clean_env) -> None:
    from gpufeed.train import Trainer

    args = train_args(shards, "--steps", "6", "--warmup-steps", "2", "--lr", "0.05", "--checkpoint-every", "0")
    invoke([*args, "--checkpoint-dir", tmp_path / "ref-ck", "--run-dir", tmp_path / "ref"])

    handler = signal.getsignal(signal.SIGTERM)
    real_advance = Trainer._advance

    def advance(self):  # a real SIGTERM, delivered during step 3
        out = real_advance(self)
        if self.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    clean_env.setattr(Trainer, "_advance", advance)
    ck = tmp_path / "ck"
    args = [*args, "--checkpoint-dir", ck]
    res = invoke([*args, "--run-dir", tmp_path / "stopped"], expect=143)
    lines = res.stderr.strip().splitlines()
    assert lines == [f"error: interrupted by SIGTERM after step 3 of 6; checkpoint at step 3 in {ck / 'last.pt'} "
                     f"(continue with --resume)"]
    assert not (tmp_path / "stopped" / "summary.json").exists()
    assert signal.getsignal(signal.SIGTERM) == handler  # the handler is put back
    state = torch.load(ck / "last.pt", map_location="cpu", weights_only=True)
    assert state["step"] == 3 and state["loader_position"]["batches_consumed"] == 3

    clean_env.setattr(Trainer, "_advance", real_advance)
    s = json.loads(invoke([*args, "--resume", "--run-dir", tmp_path / "resumed", "--json"]).stdout)
    assert s["start_step"] == 3 and s["step"] == 6
    end = torch.load(ck / "last.pt", map_location="cpu", weights_only=True)
    ref = torch.load(tmp_path / "ref-ck" / "last.pt", map_location="cpu", weights_only=True)
    assert end["step"] == ref["step"] == 6
    assert all(torch.equal(v, ref["model"][k]) for k, v in end["model"].items())
    assert all(torch.equal(v["momentum_buffer"], ref["optimizer"]["state"][k]["momentum_buffer"])
               for k, v in end["optimizer"]["state"].items())


# --------------------------------------------------------------------------- launch environments


@pytest.mark.timeout(60)
@pytest.mark.parametrize("env, says", [
    ({"RANK": "5", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"},
     "RANK=5 is not below WORLD_SIZE=2"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set but RANK, MASTER_ADDR, MASTER_PORT are not"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "29511"}, "are set but MASTER_ADDR is not"),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
      "MASTER_PORT": "29511"}, "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "70000"}, "is not a port"),
])
def test_an_inconsistent_launch_environment_is_refused_before_any_rendezvous(shards, tmp_path: Path, clean_env,
                                                                            capsys, env, says) -> None:
    from gpufeed.train.launch import main

    for k, v in env.items():
        clean_env.setenv(k, v)
    with pytest.raises(ConfigError, match=says):
        check_launch_env()
    # the rank entry point: one sentence, exit 2, at once (a rendezvous would wait for the bound)
    clean_env.setenv("GPUFEED_RENDEZVOUS_TIMEOUT_S", "30")
    config = _rank_config(shards, tmp_path)
    assert main([str(config)]) == 2  # the timeout mark fails a wait
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def test_a_consistent_or_absent_launch_environment_passes(clean_env) -> None:
    check_launch_env()  # one process
    check_launch_env({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})  # left over from a job script
    check_launch_env({"RANK": "0", "WORLD_SIZE": "1"})
    check_launch_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                      "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})


# --------------------------------------------------------------------------- bounded rendezvous


@pytest.mark.timeout(60)
def test_a_rank_that_never_joins_ends_the_rendezvous_within_its_bound_naming_it(clean_env) -> None:
    env = {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(closed_port()),
           "GPUFEED_RENDEZVOUS_TIMEOUT_S": "2"}
    with pytest.raises(RunError, match=r"rendezvous: ranks 1, 2 of 3 did not join within 2 s"):
        join(World(rank=0, world_size=3), env)


@pytest.mark.timeout(60)
def test_a_rank_whose_rank_0_never_comes_ends_within_its_bound_naming_rank_0(clean_env) -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(closed_port()),
           "GPUFEED_RENDEZVOUS_TIMEOUT_S": "2"}
    with pytest.raises(RunError, match=r"rendezvous: rank 1 could not reach the store at 127\.0\.0\.1:\d+ within "
                                       r"2 s: rank 0 did not come"):
        join(World(rank=1, world_size=2), env)


# --------------------------------------------------------------------------- checkpoint writes


class _FillsUp:
    """The file torch.save writes to when the disk fills mid-write: the first two writes reach the real
    temporary, the rest go to /dev/full (ENOSPC from the kernel), unbuffered, as a large write is."""

    def __init__(self, f, full):
        self.f, self.full, self.n = f, full, 0

    def write(self, data):
        self.n += 1
        return (self.f if self.n <= 2 else self.full).write(data)

    def flush(self):
        self.f.flush()


def _filling_writer(real):
    """``gpufeed.core.records.atomic_writer`` whose temporary fills up (:class:`_FillsUp`)."""
    import contextlib

    @contextlib.contextmanager
    def writer(path, *args, **kwargs):
        with real(path, *args, **kwargs) as f, open("/dev/full", "wb", buffering=0) as full:
            yield _FillsUp(f, full)
    return writer


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.timeout(120)
def test_a_full_disk_during_a_checkpoint_write_is_one_sentence_naming_the_file(shards, tmp_path: Path,
                                                                              clean_env) -> None:
    import gpufeed.core.records as records

    clean_env.setattr(records, "atomic_writer", _filling_writer(records.atomic_writer))
    ck = tmp_path / "ck"
    res = invoke(train_args(shards, "--steps", "1", "--checkpoint-dir", ck, "--run-dir", tmp_path / "run"),
                 expect=1)
    assert res.stderr.strip().splitlines() == [f"error: No space left on device ({ck / 'last.pt'})"]
    assert list(ck.iterdir()) == []  # no temporary left, no last.pt


@pytest.mark.timeout(60)
def test_sigint_during_a_checkpoint_write_is_interrupted_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    from gpufeed.train.checkpoint import _atomic_torch_save

    path = tmp_path / "last.pt"
    _atomic_torch_save({"step": 1, "w": torch.zeros(10)}, path)
    before = path.read_bytes()

    class Interrupting:  # the file torch.save writes to; the third write is hit by SIGINT
        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, data):
            self.n += 1
            if self.n == 3:
                os.kill(os.getpid(), signal.SIGINT)  # Python's handler raises KeyboardInterrupt here
            return self.f.write(data)

        def flush(self):
            self.f.flush()

    import gpufeed.train.checkpoint as ckpt

    real = ckpt._KeepWriteError
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ckpt, "_KeepWriteError", lambda f: real(Interrupting(f)))
        with pytest.raises(KeyboardInterrupt):
            _atomic_torch_save({"step": 2, "w": torch.ones(100_000)}, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def test_the_cli_says_interrupted_with_exit_130(shards, tmp_path: Path, clean_env) -> None:
    import gpufeed.train.checkpoint as ckpt

    def interrupted(obj, path):
        raise KeyboardInterrupt

    clean_env.setattr(ckpt, "_atomic_torch_save", interrupted)
    res = invoke(train_args(shards, "--steps", "1", "--checkpoint-dir", tmp_path / "ck", "--run-dir",
                            tmp_path / "run"), expect=130)
    assert res.stderr.strip().splitlines() == ["interrupted"]


def test_a_stale_checkpoint_temporary_is_removed_by_the_next_write_links_and_others_are_kept(tmp_path: Path) -> None:
    from gpufeed.train.checkpoint import _atomic_torch_save

    ck = tmp_path / "ck"
    ck.mkdir()
    stale = ck / ".last.pt.k3j_9x0q.tmp"  # what a write killed by SIGKILL leaves
    stale.write_bytes(b"half a checkpoint")
    target = tmp_path / "precious"
    target.write_bytes(b"keep")
    link = ck / ".last.pt.abcdefgh.tmp"
    link.symlink_to(target)
    folder = ck / ".last.pt.zzzzzzzz.tmp"
    folder.mkdir()
    others = [ck / ".other.pt.k3j_9x0q.tmp", ck / ".last.pt.k3j_9x0q.tmp.keep", ck / "last.pt.k3j_9x0q.tmp"]
    for p in others:
        p.write_bytes(b"not ours")
    _atomic_torch_save({"step": 1}, ck / "last.pt")
    assert not stale.exists()
    assert link.is_symlink() and target.read_bytes() == b"keep" and folder.is_dir()
    assert all(p.read_bytes() == b"not ours" for p in others)
    assert torch.load(ck / "last.pt", weights_only=True) == {"step": 1}


FAKE_TORCHRUN = r"""
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a torchrun that does not stop
rank = ("import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"  # a rank stuck in a collective, deaf to SIGTERM
        "open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid())); os.replace(sys.argv[1] + '.tmp', sys.argv[1])\n"
        "time.sleep(600)\n")
subprocess.Popen([sys.executable, "-c", rank, sys.argv[1]], start_new_session=True)  # as torchrun starts ranks
time.sleep(600)
"""


@pytest.mark.timeout(60)
def test_the_launcher_kills_what_ignores_the_forwarded_signal_after_its_bound(tmp_path: Path, clean_env) -> None:
    import threading

    import psutil

    from gpufeed.train.launch import run_torchrun

    clean_env.setenv("GPUFEED_STOP_GRACE_S", "1")
    marker = tmp_path / "rank.pid"

    def preempt() -> None:  # the scheduler's SIGTERM, once the "rank" runs
        deadline = time.monotonic() + 30
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=preempt, daemon=True).start()
    returncode, signum, killed = run_torchrun([sys.executable, "-c", FAKE_TORCHRUN, str(marker)], dict(os.environ))
    assert (returncode, signum, killed) == (-signal.SIGKILL, signal.SIGTERM, True)
    rank = int(marker.read_text())
    deadline = time.monotonic() + 10
    while alive([psutil.Process(rank)] if psutil.pid_exists(rank) else []) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (psutil.pid_exists(rank) and alive([psutil.Process(rank)])), "the rank outlived the launcher"


def test_a_rank_stopped_by_a_signal_keeps_its_exit_code_through_the_launcher(tmp_path: Path) -> None:
    """SIGTERM sent to the ranks directly (a scheduler signalling every process): the launcher repeats 143."""
    from gpufeed.core.errors import Interrupted
    from gpufeed.train.launch import rank_failure

    for rank in (0, 1):
        (tmp_path / f"rank-{rank}.error").write_text(json.dumps(
            {"rank": rank, "message": "interrupted by SIGTERM after step 7 of 9", "exit_code": 143,
             "cause": True, "time": 1.0 + rank}))
    err = rank_failure(tmp_path, 1)
    assert isinstance(err, Interrupted) and err.exit_code == 143
    assert str(err) == "rank 0: interrupted by SIGTERM after step 7 of 9"


def _rank_config(shards: Path, tmp_path: Path) -> Path:
    from gpufeed.config import to_toml

    config = tmp_path / "config.toml"
    cfg = tiny(shards=str(shards), steps=1, run_dir=str(tmp_path))
    config.write_text(to_toml("loader", LOADER) + "\n" + to_toml("train", cfg))
    return config


@pytest.mark.timeout(60)
def test_a_rank_alone_in_a_world_of_two_says_which_rank_did_not_come(shards, tmp_path: Path, clean_env,
                                                                     capsys) -> None:
    from gpufeed.train.launch import main

    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(closed_port()), "GPUFEED_RENDEZVOUS_TIMEOUT_S": "2"}.items():
        clean_env.setenv(k, v)
    assert main([str(_rank_config(shards, tmp_path))]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rank 0: rendezvous: rank 1 of 2 did not join within 2 s"), err
    assert json.loads((tmp_path / "rank-0.error").read_text())["exit_code"] == 1


def test_sigint_in_a_rank_is_interrupted_exit_130_without_a_traceback(shards, tmp_path: Path, clean_env,
                                                                      capsys) -> None:
    import gpufeed.train.launch as launch

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    clean_env.setattr(launch, "train", interrupted)
    assert launch.main([str(_rank_config(shards, tmp_path))]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["rank 0: interrupted"]
    assert json.loads((tmp_path / "rank-0.error").read_text())["exit_code"] == 130
