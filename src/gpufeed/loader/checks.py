"""The checks a loader can make before a run starts: the manifest, the shard files present and readable, enough
samples for one batch per rank (docs/design.md §3). ``train`` and ``tune`` both run them before their first step."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from gpufeed.config import LoaderConfig
from gpufeed.core.errors import DataError
from gpufeed.core.world import World


def open_shards(shards: str | Path, loader_cfg: LoaderConfig, world: World, *, train: bool = True,
                manifest_file: str | Path | None = None) -> Any:
    """Build the loader of ``shards`` (with ``manifest_file``, its manifest, for a brace pattern) for rank 0 of
    ``world`` (no workers start) and open every local shard once: the checks that can be made before a run starts
    (manifest, shard files present and readable, enough samples for one batch per rank). A remote set's shards are
    not fetched here: one that cannot be read is met mid-run (``on_error``). Raises DataError (exit 2); returns
    the loader."""
    from gpufeed.loader import build_loader

    loader = build_loader(shards, dataclasses.replace(loader_cfg, num_workers=0), world, train=train,
                          manifest_file=manifest_file)
    for i in [] if loader.shard_set.remote else loader.shards_here:
        path, claimed = loader.paths[i], loader.manifest.shards[i].bytes
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
        except OSError as exc:
            raise DataError(f"shard {path} cannot be opened: {exc.strerror or exc}") from None
        if size != claimed:  # the sample counts the run sizes itself by are bounded by the claimed bytes
            raise DataError(f"shard {path} is {size} bytes, the manifest says {claimed}")
    return loader
