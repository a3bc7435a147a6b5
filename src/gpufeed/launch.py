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
from gpufeed.errors import ConfigError, GpufeedError, RunError, one_line
from gpufeed.records import atomic_write_bytes, atomic_write_text, make_run_dir, to_jsonable, write_json
from gpufeed.safefs import read_set_file
from gpufeed.train import check_classes, open_shards, run_loader_config, steps_per_epoch, train
from gpufeed.train_records import CONFIG_NAME, SUMMARY_NAME
from gpufeed.world import World

TORCHRUN_FLAG = "--torchrun"
"""``python -m gpufeed.train --torchrun ARGS``: torchrun with ARGS, run by :func:`main` (see :func:`_torchrun`)."""
RANK_ERROR = "rank-{rank}.error"
"""A failed rank's one-sentence cause, written next to the run's config.toml (JSON)."""


def check_data(cfg: TrainConfig, loader_cfg: LoaderConfig, world_size: int) -> None:
    """What every rank of a ``world_size``-rank run would refuse before its first step, refused once before
    launch (DataError/ConfigError, exit 2): no shards for a data mode, an unreadable manifest, a missing or
    unreadable shard, too few samples for one step per rank."""
    if cfg.mode not in ("real", "loader-only", "measure"):
        return
    if not cfg.shards:
        raise ConfigError(f"mode {cfg.mode} needs --shards (only --synthetic runs without data)")
    lc = run_loader_config(cfg, loader_cfg)
    world = World(world_size=world_size)
    if lc.shard_split == "node":  # check the shards of one node: this one when known, else the one the set was
        from gpufeed.shardset.source import open_set  # staged for, else node 0
        from gpufeed.stage import staged_node

        nodes = max(1, world_size // max(1, cfg.nproc_per_node))
        shard_set = open_set(cfg.shards, cfg.manifest)  # any spec the loader takes (a brace pattern, a URL)
        staged = staged_node(shard_set.manifest, shard_set.location)
        node = cfg.node_rank if cfg.master_addr and cfg.node_rank is not None else staged[0] if staged else 0
        world = World(rank=node * cfg.nproc_per_node, world_size=world_size, local_world_size=cfg.nproc_per_node,
                      node_rank=min(node, nodes - 1), num_nodes=nodes)
    loader = open_shards(cfg.shards, lc, world, manifest_file=cfg.manifest)
    steps_per_epoch(cfg, loader)
    val = open_shards(cfg.val_shards, lc, world, train=False) if cfg.val_shards and cfg.mode == "real" else None
    check_classes(cfg, loader.manifest, val.manifest if val is not None else None)


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


def launch(cfg: TrainConfig, loader_cfg: LoaderConfig, layout: LayoutConfig | None = None) -> dict[str, Any]:
    """Check the data, create the run folder (resolved config, environment), run every rank, return
    summary.json as a dict.

    One process runs in-process; more go through torchrun, which re-enters :func:`main` in each rank.
    Errors: what every rank would refuse before starting is refused here (exit 2, see :func:`check_data`);
    when torchrun fails, the first rank's cause (from the ``rank-R.error`` files) is raised with that
    rank's exit code: 2 when it failed before its first step, else 1 (RunError). ``layout`` is the config's
    [layout] (the one the loader was tuned for): a different one is named in one line (``gpufeed.layout.warn``)."""
    from gpufeed.layout import warn as warn_layout
    from gpufeed.system import environment_snapshot, usable_cpus

    check_data(cfg, loader_cfg, _min_world_size(cfg))
    warn_layout(cfg, loader_cfg, layout or LayoutConfig())  # one line on stderr when not the tuned layout
    run_dir = Path(cfg.run_dir) if cfg.run_dir else make_run_dir("train")
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = dataclasses.replace(cfg, run_dir=str(run_dir))
    config_path = run_dir / CONFIG_NAME
    write_run_config(config_path, cfg, loader_cfg)
    write_json(run_dir / "environment.json", environment_snapshot())
    if not needs_torchrun(cfg):
        world = World.from_env(cfg.device)
        record = train(cfg, loader_cfg, world, run_dir=run_dir)
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
    # rank output goes to our stderr, so that stdout stays free for --json
    proc = subprocess.run(cmd, env=env, stdout=sys.__stderr__, stderr=sys.__stderr__)
    if proc.returncode != 0:
        raise rank_failure(run_dir, proc.returncode, multi_node=cfg.nnodes != "1")
    if not summary.exists():
        return {"ok": True, "run_dir": str(run_dir), "notes": [not_node_zero_note(cfg)]}
    return json.loads(summary.read_text(encoding="utf-8"))


def write_run_config(path: Path, cfg: TrainConfig, loader_cfg: LoaderConfig) -> None:
    """The resolved config.toml of a run folder, written atomically: a link at ``path`` is replaced, never written
    through (docs/threat-model.md, "Files gpufeed writes, and how")."""
    atomic_write_text(path, to_toml("loader", loader_cfg, header="Resolved configuration of this run (gpufeed train).")
                      + "\n" + to_toml("train", cfg))


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
    return GpufeedError(text) if code == 2 else RunError(text)


def _verbose() -> bool:
    return os.environ.get("GPUFEED_VERBOSE", "") not in ("", "0")


def _traceback_if_verbose() -> None:
    """The exception being handled, as a traceback on stderr, with GPUFEED_VERBOSE=1 only."""
    if _verbose():
        import traceback

        traceback.print_exc(file=sys.stderr)


def _rank_failed(report_dir: Path, rank: int, message: str, exit_code: int, *, cause: bool) -> int:
    """One sentence on stderr (a traceback first with GPUFEED_VERBOSE=1) and in ``rank-R.error``."""
    _traceback_if_verbose()
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

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if not _verbose():
        logging.disable(logging.ERROR)
    try:
        run(parse_args(args))
    except ChildFailedError:
        _traceback_if_verbose()
        return 1
    except Exception as exc:  # noqa: BLE001 - rendezvous and agent failures: one sentence
        _traceback_if_verbose()
        print(f"torchrun: {type(exc).__name__}: {one_line(exc)}", file=sys.stderr, flush=True)
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
    rank = int(os.environ.get("RANK", "0"))
    report_dir = Path(argv[0]).parent
    try:
        conf = load_config(argv[0])
        world = World.from_env(conf.train.device)
        train(conf.train, conf.loader, world, run_dir=conf.train.run_dir)
    except GpufeedError as exc:
        return _rank_failed(report_dir, rank, one_line(exc), exc.exit_code, cause=True)
    except Exception as exc:  # noqa: BLE001 - a bug or a consequence (a peer died): one sentence
        return _rank_failed(report_dir, rank, f"unexpected {type(exc).__name__}: {one_line(exc)}", 1, cause=False)
    return 0  # rank 0 wrote summary.json; the launcher sets the exit code from it

