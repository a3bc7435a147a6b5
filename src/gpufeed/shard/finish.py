"""Phase 5, finish: once every shard is complete, ``index.parquet`` (built and written a row group at a time),
the sidecar indexes (timm's ``_info.json``, wids' ``wids.json``, DALI's ``.idx`` files: ``gpufeed.shardset.sidecars``) and,
last and atomically, ``manifest.json`` (docs/design.md §2)."""

from __future__ import annotations

import os
from typing import Any

from gpufeed.config import ShardConfig
from gpufeed.shard.scan import display
from gpufeed.shard.shardplan import Plan

_INDEX_BLOCK = 65536
"""Rows of ``index.parquet`` built and written at a time (one row group each)."""


def _index_keys(plan: Plan, rows: Any, labels: Any) -> Any:
    """The ``key`` column (``{label:05d}_{n:07d}``) as an Arrow string array, digits computed with numpy a block
    at a time (wider numbers, which ``:05d``/``:07d`` would not pad to a fixed width, go through ``plan.key``)."""
    import numpy as np
    import pyarrow as pa

    n = rows - plan.class_start[labels]
    if len(rows) and (labels.max() >= 10**5 or n.max() >= 10**7):
        return pa.concat_arrays([pa.array([plan.key(i) for i in rows[b:b + _INDEX_BLOCK].tolist()], pa.string())
                                 for b in range(0, len(rows), _INDEX_BLOCK)])
    blocks = []
    for b in range(0, len(rows), _INDEX_BLOCK):
        lab, num = labels[b:b + _INDEX_BLOCK].astype(np.int64), n[b:b + _INDEX_BLOCK]
        chars = np.empty((len(lab), 13), dtype=np.uint8)
        chars[:, :5] = lab[:, None] // 10 ** np.arange(4, -1, -1) % 10 + 48
        chars[:, 5] = ord("_")
        chars[:, 6:] = num[:, None] // 10 ** np.arange(6, -1, -1) % 10 + 48
        offsets = np.arange(0, 13 * (len(lab) + 1), 13, dtype=np.int32)
        blocks.append(pa.Array.from_buffers(pa.string(), len(lab), [None, pa.py_buffer(offsets),
                                                                    pa.py_buffer(chars.tobytes())]))
    return pa.concat_arrays(blocks) if blocks else pa.array([], pa.string())


def _path_names(plan: Plan) -> Any:
    """Every path of the plan as one Arrow binary array over the path blob (no copy of the names), or None when
    the blob is too large for 32-bit offsets or paths are not '/'-separated."""
    import pyarrow as pa

    if os.sep != "/" or len(plan.paths.blob) >= 2**31:
        return None
    return pa.Array.from_buffers(pa.binary(), len(plan.paths), [
        None, pa.py_buffer(plan.paths.offsets.astype("int32")), pa.py_buffer(plan.paths.blob)])


def _index_sources(plan: Plan, rows: Any, names: Any) -> Any:
    """The ``source`` column (``display`` of each path) as an Arrow string array: straight from ``names``
    (``_path_names``) when every name is UTF-8 (then ``display`` is the name itself), else name by name."""
    import pyarrow as pa

    if names is not None:
        try:
            return names.take(pa.array(rows)).cast(pa.string())
        except pa.ArrowInvalid:  # a name that is not UTF-8
            pass
    return pa.concat_arrays([pa.array([display(plan.paths[i]) for i in rows[b:b + _INDEX_BLOCK].tolist()],
                                      pa.string()) for b in range(0, len(rows), _INDEX_BLOCK)])


def _write_index(path: str, plan: Plan) -> list[str]:
    """``index.parquet`` in plan order (shard by shard: the shards are consecutive slices of ``order``), built
    and written a row group of ``_INDEX_BLOCK`` rows at a time, so only one block's columns are held besides
    the plan. Returns each shard's key digest (the manifest's ``keys_sha256``: members are written in plan order,
    so a shard's keys are its slice of the index)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gpufeed.shardset.manifest import INDEX_DICTIONARY_COLUMNS, index_table
    from gpufeed.core.records import atomic_writer
    from gpufeed.shardset.keys import KeyDigest

    order = plan.cols["order"]
    digests = [KeyDigest() for _ in plan.shards]
    starts = np.array([s.start for s in plan.shards], dtype=np.int64)
    shard_names = pa.array([s.name for s in plan.shards], pa.string())
    class_names = pa.array(plan.classes, pa.string())
    names = _path_names(plan)
    with atomic_writer(path) as f:
        writer = None
        for b in range(0, len(order), _INDEX_BLOCK):
            rows = order[b:b + _INDEX_BLOCK]
            shard_of = np.searchsorted(starts, np.arange(b, b + len(rows)), side="right") - 1
            labels = plan.cols["label"][rows]
            nbytes, width, height = plan.stored(rows)
            keys = _index_keys(plan, rows, labels)
            cuts = np.flatnonzero(np.diff(shard_of)) + 1  # the block's shard slices
            for a, z in zip([0, *cuts.tolist()], [*cuts.tolist(), len(rows)]):
                digests[int(shard_of[a])].update_arrow(keys.slice(a, z - a))
            table = index_table({
                "key": keys,
                "shard": shard_names.take(pa.array(shard_of)),
                "class": class_names.take(pa.array(labels)),
                "label": pa.array(labels.astype(np.int64), pa.int64()),
                "source": _index_sources(plan, rows, names),
                "bytes": pa.array(nbytes.astype(np.int64), pa.int64()),
                "width": pa.array(width.astype(np.int32), pa.int32()),
                "height": pa.array(height.astype(np.int32), pa.int32()),
            })
            if writer is None:
                writer = pq.ParquetWriter(f, table.schema, memory_pool=pa.default_memory_pool(),
                                          use_dictionary=list(INDEX_DICTIONARY_COLUMNS))
            writer.write_table(table)
            del table
        assert writer is not None  # a plan has at least one sample
        writer.close()
    return [d.hexdigest() for d in digests]


def finish_set(dest: str, cfg: ShardConfig, plan: Plan, infos: list[dict[str, Any]],
               options: dict[str, Any], notes: list[str] | None = None, indexed: set[str] | None = None) -> Any:
    """The index, the sidecar indexes (``notes`` gets a sentence for each one not written; ``indexed``: the shards
    whose DALI index the writer wrote from its layout, the others' are read from their tar headers) and the
    manifest."""
    notes = [] if notes is None else notes
    import pyarrow as pa

    from gpufeed import __version__
    from gpufeed.shardset.manifest import INDEX_NAME, Manifest, ShardInfo, brace_pattern, write_manifest
    from gpufeed.shardset.sidecars import write_sidecars

    # The index's arrays come from the system allocator (``procs.map_large_blocks``: its large blocks go back to the OS
    # when freed); pyarrow's default pool (mimalloc or jemalloc) keeps what it frees for a while.
    pool = pa.default_memory_pool()
    pa.set_memory_pool(pa.system_memory_pool())
    try:
        key_digests = _write_index(os.path.join(dest, INDEX_NAME), plan)
    finally:
        pa.set_memory_pool(pool)

    names = [i["name"] for i in infos]
    keys_of = {s.name: d for s, d in zip(plan.shards, key_digests)}
    shard_infos = [ShardInfo(name=i["name"], num_samples=i["num_samples"], bytes=i["bytes"], sha256=i["sha256"],
                             keys_sha256=keys_of.get(i["name"])) for i in infos]
    total = sum(i["bytes"] for i in infos)
    n = sum(i["num_samples"] for i in infos)
    manifest = Manifest(
        prefix=cfg.prefix, classes=list(plan.classes), shards=shard_infos, num_samples=n,
        num_rejected=len(plan.rejected), total_bytes=total, mean_sample_bytes=total / n if n else 0.0,
        url_pattern=brace_pattern(names), options=options, created_by="gpufeed shard",
        gpufeed_version=__version__,
    )
    # timm's _info.json, wids.json and DALI's .idx files (gpufeed.shardset.sidecars), from the manifest and the shards
    notes += write_sidecars(dest, shard_infos, [os.path.join(dest, name) for name in names], prefix=cfg.prefix,
                            num_classes=len(plan.classes), compression=None,
                            name=os.path.basename(dest.rstrip("/")) or "gpufeed", indexed=indexed)
    write_manifest(dest, manifest)  # last: its presence means the set is complete
    return manifest
