"""The verdict's numbers from a run's modes (docs/design.md §4): the modes' records, the run's layout, and the
storage rate with the sizes its stage fix names."""

from __future__ import annotations

from typing import Any

from gpufeed.measure.storage_rate import StorageRate
from gpufeed.measure.verdict import ModeNeighbours, ModeWindows, VerdictInputs
from gpufeed.train.records import ModeRecord


def _shm_free_bytes() -> int | None:
    """Free bytes in /dev/shm; None where there is none."""
    import shutil

    try:
        return int(shutil.disk_usage("/dev/shm").free)
    except OSError:
        return None


def mode_neighbours(modes: dict[str, ModeRecord]) -> tuple[ModeNeighbours, ...]:
    """Per mode, what other processes held on its busiest node and the largest of them (modes without a reading
    are left out)."""
    out = []
    for name, m in modes.items():
        if m.other_cores is None:
            continue
        p = m.other_process
        node = next((n.node for n in m.per_node if n.other_cores == m.other_cores), 0)
        out.append(ModeNeighbours(name, m.other_cores, m.machine_cores, p.name if p else None, p.pid if p else None,
                                  p.cores if p else None, p.gpu_mem_bytes if p else None, node))
    return tuple(out)


def mode_windows(modes: dict[str, ModeRecord]) -> tuple[ModeWindows, ...]:
    """Per mode judged by --measure, whether its windows settled."""
    return tuple(ModeWindows(name, bool(m.settled), m.samples_per_s_stat.n if m.samples_per_s_stat else 0,
                             m.rate_spread, m.stall_spread_pts) for name, m in modes.items() if m.settled is not None)


def compute_step_s(m: ModeRecord | None) -> float | None:
    """Compute seconds per optimizer step, mean over ranks."""
    if m is None or not m.num_steps or not m.num_ranks:
        return None
    return m.compute_s / (m.num_steps * m.num_ranks)


def _slowdowns(m: ModeRecord | None) -> tuple[str, ...]:
    if m is None:
        return ()
    return tuple(sorted({r for rank in m.per_rank for r in (rank.gpu or {}).get("slowdowns", ())}))


def verdict_inputs(modes: dict[str, ModeRecord], trainer: Any,
                   storage: StorageRate | None = None) -> VerdictInputs | None:
    """The verdict's numbers: the modes' records, the run's layout, and the storage rate with the sizes its
    stage fix names (the set's bytes, /dev/shm's free bytes). ``trainer`` is the
    :class:`~gpufeed.train.trainer.Trainer`, or anything with its ``cfg``, ``loader_cfg``, ``world``, ``num_nodes``,
    ``cuda`` and ``manifest``."""
    real = modes.get("real")
    if real is None or real.num_steps == 0:
        return None
    synth, lonly = modes.get("synthetic"), modes.get("loader-only")
    from gpufeed.core.system import usable_cpus

    manifest = trainer.manifest
    read_rate = (lonly or real).read_bytes_per_s
    from gpufeed.shardset.source import is_url

    remote = is_url(str(trainer.cfg.shards or ""))
    if manifest is not None and remote:
        # a remote set is read over sockets, which the storage I/O counters behind read_bytes do not count: the
        # loader moves the manifest's mean bytes per sample, so it reads its samples/s (per node) times that
        read_rate = (lonly or real).samples_per_s / max(1, trainer.num_nodes) * manifest.mean_sample_bytes
    set_bytes = manifest.total_bytes if manifest else None
    stage_nodes = trainer.num_nodes if trainer.loader_cfg.shard_split == "node" and trainer.num_nodes > 1 else None
    if manifest is not None and stage_nodes:  # each node stages only its own shards: the largest share must fit
        from gpufeed.core.world import node_shards

        set_bytes = max(sum(manifest.shards[i].bytes for i in node_shards(len(manifest.shards), n, stage_nodes))
                        for n in range(stage_nodes))

    return VerdictInputs(
        stall_pct=real.stall_pct, end_to_end_rate=real.samples_per_s,
        gpu_ceiling=synth.samples_per_s if synth else None,
        loader_ceiling=lonly.samples_per_s if lonly else None,
        per_rank_stall_pct=tuple(r.stall_pct for r in real.per_rank),
        copy_wait_pct=real.copy_wait_pct,
        loader_cores_used=lonly.loader_cores_used if lonly else None,
        usable_cores=float(usable_cpus()), num_nodes=trainer.num_nodes,
        ranks_per_node=trainer.world.local_world_size,
        num_workers=trainer.loader_cfg.num_workers,
        remote_streams=trainer.loader_cfg.remote_streams if remote else None,
        read_bytes_per_s=read_rate,
        storage_bytes_per_s=storage.bytes_per_s if storage else None,
        storage_source=storage.source if storage else None,
        storage_ladder=tuple((int(r), float(b)) for r, b in storage.ladder) if storage else (),
        shards=trainer.cfg.shards, set_bytes=set_bytes, stage_nodes=stage_nodes,
        shm_free_bytes=_shm_free_bytes(),
        mean_sample_bytes=manifest.mean_sample_bytes if manifest else None,
        decode=trainer.loader_cfg.decode, is_cuda=trainer.cuda,
        neighbours=mode_neighbours(modes), windows=mode_windows(modes),
        real_compute_step_s=compute_step_s(real), synthetic_compute_step_s=compute_step_s(synth),
        real_cores_used=real.loader_cores_used / trainer.num_nodes if real.loader_cores_used is not None else None,
        synthetic_cores_used=(synth.loader_cores_used / trainer.num_nodes
                              if synth is not None and synth.loader_cores_used is not None else None),
        gpu_slowdowns=_slowdowns(real), synthetic_gpu_slowdowns=_slowdowns(synth),
        real_batch=real.batch, synthetic_batch=synth.batch if synth else None,
    )
