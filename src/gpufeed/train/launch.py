"""Launching ``gpufeed train``: the run folder, torchrun, and what a failed rank leaves behind (docs/design.md §5).

:func:`launch` checks the data once (:func:`check_data`), writes the run folder's config.toml and
environment.json, then runs one process in-process or more through torchrun
(``python -m gpufeed.train --torchrun ... -m gpufeed.train CONFIG``, :func:`torchrun_command`), which
re-enters :func:`main` in each rank.

Failures: what every rank would refuse before its first step (no shards, a missing shard, too few samples)
is refused here, exit 2. Under torchrun each failed rank prints ``rank R: <one sentence>`` and writes it to
``rank-R.error`` (:func:`main`); the launcher repeats the first cause (:func:`rank_failure`) with that rank's
exit code: 2 when it failed before its first step, else 1.

More than one node (``--nnodes N``): every node runs ``gpufeed train`` with the same options and rendezvous;
each launcher checks the data, writes its run folder and starts its node's ranks through torchrun. Rank 0
writes summary.json into the run folder of its node (node 0); the launchers of the other nodes return
:func:`not_node_zero_note`. When a rank fails, every node's launcher exits non-zero with one sentence.

Signals: torchrun runs in its own process group. SIGTERM, SIGINT or SIGHUP to the launcher is forwarded to
that group (torchrun passes it to the ranks; a second signal SIGKILLs them at once); the launcher waits up to
:data:`STOP_GRACE_S` for torchrun and its ranks, SIGKILLs what is left, and exits with 128 + the signal
(:class:`gpufeed.core.errors.Interrupted`). torchrun and every rank die with their parent (``PR_SET_PDEATHSIG``),
so even a ``kill -9`` of the launcher leaves no rank training. A rank sent SIGTERM stops at its next step
boundary after a checkpoint (:class:`gpufeed.train.StopRequest`); one sent SIGINT stops at once ("interrupted",
exit 130).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpufeed.config import LayoutConfig, LoaderConfig, TrainConfig, load_config, to_toml
from gpufeed.core.errors import ConfigError, GpufeedError, Interrupted, RunError, one_line, signal_name
from gpufeed.core.records import atomic_write_bytes, make_run_dir, to_jsonable, write_json
from gpufeed.core.redact import redact
from gpufeed.core.safefs import read_set_file
from gpufeed.train.fix import Stager
from gpufeed.train.job import train
from gpufeed.train.preflight import check_data
from gpufeed.train.records import CONFIG_NAME, SUMMARY_NAME
from gpufeed.core.world import World

TORCHRUN_FLAG = "--torchrun"
"""``python -m gpufeed.train --torchrun ARGS``: torchrun with ARGS, run by :func:`main` (see :func:`_torchrun`)."""
RANK_ERROR = "rank-{rank}.error"
"""A failed rank's one-sentence cause, written next to the run's config.toml (JSON)."""
STOP_GRACE_S = 45.0
"""After forwarding a signal to torchrun, how long the launcher waits for it and its ranks (torchrun gives the
ranks 30 s, then SIGKILLs them) before it SIGKILLs whatever is left; ``GPUFEED_STOP_GRACE_S`` overrides it."""
FORWARDED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")
"""Signals the launcher passes on to torchrun's process group."""


def needs_torchrun(cfg: TrainConfig) -> bool:
    return cfg.nproc_per_node > 1 or cfg.nnodes != "1"


def torchrun_command(cfg: TrainConfig, config_path: str | Path) -> list[str]:
    """``python -m gpufeed.train --torchrun [rendezvous] -m gpufeed.train CONFIG``."""
    cmd = [sys.executable, "-m", "gpufeed.train", TORCHRUN_FLAG, "--nproc-per-node", str(cfg.nproc_per_node),
           "--nnodes", cfg.nnodes]
    if cfg.rdzv_endpoint:
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", cfg.rdzv_endpoint, "--rdzv-id", cfg.rdzv_id]
    elif cfg.master_addr:
        cmd += ["--node-rank", str(cfg.node_rank or 0), "--master-addr", cfg.master_addr,
                "--master-port", str(cfg.master_port or 29500)]
    elif cfg.nnodes == "1":
        cmd += ["--standalone"]
    else:
        raise ConfigError(f"nnodes={cfg.nnodes} needs --rdzv-endpoint HOST[:PORT] or --master-addr/--master-port")
    return cmd + ["-m", "gpufeed.train", str(config_path)]


def _min_world_size(cfg: TrainConfig) -> int:
    """Ranks of the smallest world ``nnodes`` (N or MIN:MAX) allows."""
    return max(1, int(cfg.nnodes.split(":")[0])) * max(1, cfg.nproc_per_node)


def launch(cfg: TrainConfig, loader_cfg: LoaderConfig, layout: LayoutConfig | None = None, *,
           stager: Stager | None = None) -> dict[str, Any]:
    """Check the data, create the run folder (resolved config, environment), run every rank, return
    summary.json as a dict.

    One process runs in-process; more go through torchrun, which re-enters :func:`main` in each rank.
    Errors: what every rank would refuse before starting is refused here (exit 2, see :func:`check_data`);
    when torchrun fails, the first rank's cause (from the ``rank-R.error`` files) is raised with that
    rank's exit code: 2 when it failed before its first step, else 1 (RunError). ``layout`` is the config's
    [layout] (the one the loader was tuned for): a different one is named in one line (``gpufeed.layout.run_warning``).
    ``stager`` stages the set for ``--fix`` in a single-process run (:mod:`gpufeed.train.fix`)."""
    from gpufeed.layout import run_warning
    from gpufeed.core.system import environment_snapshot, usable_cpus

    if not needs_torchrun(cfg):  # this process is the run: refuse a launch environment that would hang it
        from gpufeed.core.world import check_launch_env

        check_launch_env()
    check_data(cfg, loader_cfg, _min_world_size(cfg))
    if (line := run_warning(cfg, loader_cfg, layout or LayoutConfig())):  # one line when not the tuned layout
        print(line, file=sys.stderr, flush=True)
    run_dir = Path(cfg.run_dir) if cfg.run_dir else make_run_dir("train")
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = dataclasses.replace(cfg, run_dir=str(run_dir))
    config_path = run_dir / CONFIG_NAME
    write_run_config(config_path, cfg, loader_cfg)
    write_json(run_dir / "environment.json", environment_snapshot())
    if not needs_torchrun(cfg):
        world = World.from_env(cfg.device)
        record = train(cfg, loader_cfg, world, run_dir=run_dir, stager=stager)
        return to_jsonable(record)
    env = dict(os.environ)
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(cfg.threads or max(1, usable_cpus() // cfg.nproc_per_node))
    env.setdefault("PYTHONUNBUFFERED", "1")
    cmd = torchrun_command(cfg, config_path)
    summary = run_dir / SUMMARY_NAME
    # a reused run folder: only this run's causes count, and only this run's summary (a node without rank 0
    # must not return an old one)
    for old in [*run_dir.glob(RANK_ERROR.format(rank="*")), summary]:
        old.unlink(missing_ok=True)
    returncode, signum, killed = run_torchrun(cmd, env)
    if signum:
        raise interrupted(run_dir, signum, killed)
    if returncode != 0:
        raise rank_failure(run_dir, returncode, multi_node=cfg.nnodes != "1")
    if not summary.exists():
        return {"ok": True, "run_dir": str(run_dir), "notes": [not_node_zero_note(cfg)]}
    return json.loads(summary.read_text(encoding="utf-8"))


def _stop_grace_s() -> float:
    raw = os.environ.get("GPUFEED_STOP_GRACE_S", "")
    try:
        value = float(raw) if raw else STOP_GRACE_S
    except ValueError:
        raise ConfigError(f"GPUFEED_STOP_GRACE_S={raw[:40]!r} is not a number of seconds") from None
    if not 0 < value <= 3600:
        raise ConfigError(f"GPUFEED_STOP_GRACE_S={raw[:40]!r} is not in (0, 3600] seconds")
    return value


def _descendants(proc: subprocess.Popen) -> list[Any]:
    """psutil handles of ``proc``'s descendants (empty once it is gone)."""
    import psutil

    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        return []


def _kill(processes: list[Any]) -> None:
    import psutil

    for p in processes:
        try:
            p.kill()  # psutil checks the process is still the one listed (pid and start time)
        except psutil.Error:
            pass


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)  # its own session: the group id is its pid
    except (ProcessLookupError, PermissionError):
        pass


def run_torchrun(cmd: list[str], env: dict[str, str]) -> tuple[int, int, bool]:
    """Run ``cmd`` (torchrun) in its own process group, its output on our stderr (stdout stays free for
    --json), passing on :data:`FORWARDED_SIGNALS`: ``(exit code, the signal received or 0, whether processes had
    to be SIGKILLed)``.

    After a signal, torchrun and its descendants get :data:`STOP_GRACE_S` to stop (a second signal: none); then
    the group and every descendant seen are SIGKILLed. Descendants still running once torchrun has exited are
    orphans and are SIGKILLed too. Handlers are installed only in the main thread and restored on return."""
    import signal
    import threading

    grace = _stop_grace_s()
    got: list[int] = []
    proc: subprocess.Popen | None = None

    def forward(signum: int, _frame: Any) -> None:
        got.append(signum)
        if proc is not None:
            _signal_group(proc, signum if len(got) == 1 else signal.SIGKILL)

    old: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for name in FORWARDED_SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                old[sig] = signal.signal(sig, forward)
    seen: list[Any] = []
    killed = False
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=sys.__stderr__, stderr=sys.__stderr__, start_new_session=True)
        if got:  # a signal that came while Popen ran
            _signal_group(proc, got[0])
        deadline: float | None = None
        while True:
            try:
                returncode = proc.wait(timeout=0.25)
                break
            except subprocess.TimeoutExpired:
                pass
            if not got:
                continue
            seen = list({p.pid: p for p in [*seen, *_descendants(proc)]}.values())
            if deadline is None:
                deadline = time.perf_counter() + grace
            if len(got) > 1 or time.perf_counter() >= deadline:
                _signal_group(proc, signal.SIGKILL)
                _kill(seen)
                killed = True
                returncode = proc.wait()
                break
        left = [p for p in seen if p.is_running()]
        if left:
            _kill(left)
            killed = True
        return returncode, (got[0] if got else 0), killed
    except BaseException:
        if proc is not None and proc.poll() is None:
            rest = _descendants(proc)
            _signal_group(proc, signal.SIGKILL)
            _kill(rest)
            proc.wait()
        raise
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def interrupted(run_dir: Path, signum: int, killed: bool) -> Interrupted:
    """The launcher's sentence for a run stopped by ``signum``: what rank 0 said it did (its checkpoint), and
    whether ranks had to be killed."""
    head = f"interrupted by {signal_name(signum)}"
    text = f"{head}; the ranks were stopped"
    try:
        with open(run_dir / RANK_ERROR.format(rank=0), "rb") as f:
            report = json.loads(f.read(65536))
        message = one_line(str(report["message"]))
        if message.startswith(f"{head} after step "):  # rank 0 stopped at a step boundary (and saved it)
            text = f"{head}; the ranks stopped {message[len(head) + 1:]}"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if killed:
        text += f"; processes still running after {_stop_grace_s():.0f} s were killed"
    return Interrupted(text, signum)


def write_run_config(path: Path, cfg: TrainConfig, loader_cfg: LoaderConfig) -> None:
    """The resolved config.toml of a run folder, written atomically: a link at ``path`` is replaced, never written
    through (docs/threat-model.md, "Files gpufeed writes, and how"). The ranks read the URLs back as typed,
    password included: then only this user may read the file (0600)."""
    text = (to_toml("loader", loader_cfg, header="Resolved configuration of this run (gpufeed train).") + "\n"
            + to_toml("train", cfg))
    atomic_write_bytes(path, text.encode("utf-8"), mode=0o600 if redact(text) != text else None)


def not_node_zero_note(cfg: TrainConfig) -> str:
    """What the launcher of a node without rank 0 says: its ranks ran, and where the summary is."""
    if cfg.rdzv_endpoint:
        return ("this node ran its ranks; the summary and verdict are in the run folder of node 0 (with "
                "--rdzv-endpoint torchrun numbers the nodes itself: the one whose launcher printed the summary)")
    return (f"this node (node rank {cfg.node_rank or 0}) ran its ranks; the summary and verdict are in the run "
            f"folder of node 0 (--node-rank 0)")


def rank_failure(run_dir: Path, returncode: int, *, multi_node: bool = False) -> GpufeedError:
    """The error for a failed torchrun: the first cause the ranks wrote to ``run_dir/rank-R.error``.

    A GpufeedError in a rank is a cause; an unexpected exception is usually a consequence (a peer died
    under a collective), so it is reported only when no rank named a cause. Among causes, the earliest.
    The error keeps the rank's exit code: 2 (GpufeedError) when it failed before its first step, else 1.
    Each node's launcher sees only its own ranks' files: with ``multi_node`` and no cause here, the
    sentence points to the other nodes, where the rank that failed first reported it."""
    reports = []
    for path in sorted(run_dir.glob(RANK_ERROR.format(rank="*")))[:4096]:
        try:  # the run folder's own file: bounded, never through a link out of it, never a FIFO (safefs)
            r = json.loads(read_set_file(path, run_dir, 65536, what="rank report", where="run folder"))
            reports.append((not r["cause"], float(r["time"]), int(r["rank"]), one_line(str(r["message"])),
                            int(r["exit_code"])))
        except (OSError, ValueError, KeyError, TypeError, GpufeedError):
            continue  # a half-written or foreign file: the other ranks' reports still count
    if not reports:
        return RunError(f"torchrun exited with {returncode} and no rank reported a cause (killed by a signal or "
                        f"out of memory?); see the output above and {run_dir}")
    consequence, _, rank, message, code = min(reports)
    text = f"rank {rank}: {message}"
    if consequence and multi_node:
        text += " (no rank of this node named a cause: see the other nodes' output)"
    if 128 < code < 160:  # a rank stopped by a signal it was sent (not through this launcher)
        return Interrupted(text, code - 128)
    return GpufeedError(text) if code == 2 else RunError(text)


def _verbose() -> bool:
    return os.environ.get("GPUFEED_VERBOSE", "") not in ("", "0")


def _traceback_if_verbose() -> None:
    """The exception being handled, as a traceback on stderr, with GPUFEED_VERBOSE=1 only."""
    if _verbose():
        import traceback

        print(redact(traceback.format_exc()), end="", file=sys.stderr)


def _rank_failed(report_dir: Path, rank: int, message: str, exit_code: int, *, cause: bool) -> int:
    """One sentence on stderr (a traceback first with GPUFEED_VERBOSE=1) and in ``rank-R.error``."""
    _traceback_if_verbose()
    message = redact(message)
    print(f"rank {rank}: {message}", file=sys.stderr, flush=True)
    # a wall-clock timestamp, not a duration: it orders the failures of ranks in different processes (and nodes)
    report = {"rank": rank, "message": message, "exit_code": exit_code, "cause": cause, "time": time.time()}
    try:
        atomic_write_bytes(report_dir / RANK_ERROR.format(rank=rank), json.dumps(report).encode())
    except OSError:
        pass  # the sentence above is on stderr; the launcher falls back to the exit code
    return exit_code


def _torchrun(args: list[str]) -> int:
    """torchrun with ``args``, ending quietly when a rank fails: the ranks printed their one sentence, and
    the launcher repeats the first cause. torchrun's own logs and its ChildFailedError report are shown
    only with GPUFEED_VERBOSE=1."""
    import logging

    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from gpufeed.core.system import die_with_parent

    die_with_parent(os.getppid())  # the launcher killed with SIGKILL: torchrun (and so its ranks) go too
    if not _verbose():
        logging.disable(logging.ERROR)
    try:
        run(parse_args(args))
    except ChildFailedError:
        _traceback_if_verbose()
        return 1
    except SignalException as exc:  # the launcher forwarded a signal; torchrun stopped the ranks with it
        _traceback_if_verbose()
        return 128 + int(exc.sigval)
    except Exception as exc:  # noqa: BLE001 - rendezvous and agent failures: one sentence
        _traceback_if_verbose()
        print(redact(f"torchrun: {type(exc).__name__}: {one_line(exc)}"), file=sys.stderr, flush=True)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """Rank entry point under torchrun: ``python -m gpufeed.train RUN_DIR/config.toml``; with ``--torchrun``
    first, the launcher's torchrun (:func:`_torchrun`).

    A rank that fails prints ``rank R: <one sentence>`` and writes it to ``RUN_DIR/rank-R.error``; it exits
    with the error's exit code (2: failed before its first step, 1: after, or an unexpected exception)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [TORCHRUN_FLAG]:
        return _torchrun(argv[1:])
    if len(argv) != 1:
        print("usage: python -m gpufeed.train CONFIG.toml (normally started by gpufeed train)", file=sys.stderr)
        return 2
    from gpufeed.core.system import die_with_parent

    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun: when it is killed, this rank stops too
        die_with_parent(os.getppid())
    raw_rank = os.environ.get("RANK", "0")
    rank = int(raw_rank) if raw_rank.isdecimal() and len(raw_rank) <= 9 else 0
    report_dir = Path(argv[0]).parent
    try:
        conf = load_config(argv[0])
        world = World.from_env(conf.train.device)
        train(conf.train, conf.loader, world, run_dir=conf.train.run_dir)
    except GpufeedError as exc:
        return _rank_failed(report_dir, rank, one_line(exc), exc.exit_code, cause=True)
    except KeyboardInterrupt:  # SIGINT: stop at once, one word, no traceback
        return _rank_failed(report_dir, rank, "interrupted", 130, cause=True)
    except Exception as exc:  # noqa: BLE001 - a bug or a consequence (a peer died): one sentence
        return _rank_failed(report_dir, rank, f"unexpected {type(exc).__name__}: {one_line(exc)}", 1, cause=False)
    return 0  # rank 0 wrote summary.json; the launcher sets the exit code from it

