"""One object knows the world: rank, world size, node, ranks per node, device and backend. Built once, passed in."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str = "cpu"
    """'cuda:N' or 'cpu'."""
    backend: str = "gloo"
    """'nccl' on CUDA, 'gloo' otherwise."""
    local_world_size: int = 1
    """Ranks on this node (torchrun's LOCAL_WORLD_SIZE)."""
    node_rank: int = 0
    """This rank's node, 0..num_nodes-1 (torchrun's GROUP_RANK)."""
    num_nodes: int = 1
    """Nodes of the job (torchrun's GROUP_WORLD_SIZE)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @classmethod
    def from_env(cls, device: str | None = None) -> "World":
        """Read torchrun's RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE / GROUP_RANK / GROUP_WORLD_SIZE;
        pick CUDA when available unless told otherwise. Without GROUP_WORLD_SIZE the nodes are counted as
        world size / ranks per node; without GROUP_RANK the node is RANK // LOCAL_WORLD_SIZE (the ranks of a node are
        consecutive, as torchrun numbers them), not node 0 for every rank, which under ``shard_split = "node"`` would
        make every node read node 0's shards. A variable that is set but not a non-negative integer is a
        ConfigError naming it.

        Under torchrun (WORLD_SIZE > 1) every CUDA rank takes ``cuda:LOCAL_RANK``, whatever index ``device``
        names: one GPU per rank. A single process keeps the ``cuda:N`` it was given.
        """
        import torch

        rank = _env_int("RANK", 0)
        world_size = _env_int("WORLD_SIZE", 1)
        local_rank = _env_int("LOCAL_RANK", 0)
        local_world_size = _env_int("LOCAL_WORLD_SIZE", 1)
        node_rank = _env_int("GROUP_RANK", rank // max(1, local_world_size))
        num_nodes = _env_int("GROUP_WORLD_SIZE", 0) or max(1, world_size // max(1, local_world_size))
        if device is None or device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" or (device.startswith("cuda") and world_size > 1):
            device = f"cuda:{local_rank}"
        backend = "nccl" if device.startswith("cuda") else "gloo"
        return cls(rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=local_world_size,
                   node_rank=node_rank, num_nodes=num_nodes, device=device, backend=backend)

    @classmethod
    def single(cls, device: str = "cpu") -> "World":
        """A one-process world (tune, benchmarks, tests)."""
        backend = "nccl" if device.startswith("cuda") else "gloo"
        return cls(device=device, backend=backend)


def _env_int(name: str, default: int) -> int:
    """The launcher variable ``name`` as a non-negative integer (at most 9 digits), ``default`` when unset; anything
    else is a ConfigError naming it (one sentence, not a traceback)."""
    from gpufeed.errors import ConfigError

    raw = os.environ.get(name)
    if raw is None:
        return default
    text = raw.strip()
    if not (text.isascii() and text.isdigit() and len(text) <= 9):
        raise ConfigError(f"environment variable {name}={raw[:40]!r} is not a non-negative integer (set by the "
                          f"launcher: torchrun or your job script)")
    return int(text)


def node_shards(num_shards: int, node_rank: int, num_nodes: int) -> list[int]:
    """The shards node ``node_rank`` of ``num_nodes`` owns under ``[loader] shard_split = "node"``: every shard
    index ``i`` with ``i % num_nodes == node_rank``, in index order. THE ownership rule: the loader reads only
    these and ``gpufeed stage --num-nodes`` copies only these."""
    if not 0 <= node_rank < num_nodes:
        raise ValueError(f"node_rank {node_rank} is not in 0..{num_nodes - 1}")
    return list(range(node_rank, num_shards, num_nodes))


NODE_ENV = (("GROUP_RANK", "GROUP_WORLD_SIZE"), ("SLURM_NODEID", "SLURM_JOB_NUM_NODES"))
"""Launcher variables that name this node and the node count, in order of preference: torchrun's, then SLURM's."""


def node_from_env(environ: dict[str, str] | None = None) -> tuple[int | None, int | None]:
    """``(node_rank, num_nodes)`` from the first launcher pair of :data:`NODE_ENV` whose two variables are both set
    to decimal numbers (at most 6 digits); ``(None, None)`` when none is."""
    env = os.environ if environ is None else environ
    for rank_var, count_var in NODE_ENV:
        rank, count = env.get(rank_var, ""), env.get(count_var, "")
        if rank.isdecimal() and count.isdecimal() and len(rank) <= 6 and len(count) <= 6:
            return int(rank), int(count)
    return None, None
