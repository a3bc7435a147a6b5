"""One object knows the world: rank, world size, ranks per node, device and backend. Built once, passed in."""

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

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))

    @classmethod
    def from_env(cls, device: str | None = None) -> "World":
        """Read torchrun's RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE; pick CUDA when available unless
        told otherwise.

        Under torchrun (WORLD_SIZE > 1) every CUDA rank takes ``cuda:LOCAL_RANK``, whatever index ``device``
        names: one GPU per rank. A single process keeps the ``cuda:N`` it was given.
        """
        import torch

        rank = int(os.environ.get("RANK", "0"))
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if device is None or device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" or (device.startswith("cuda") and world_size > 1):
            device = f"cuda:{local_rank}"
        backend = "nccl" if device.startswith("cuda") else "gloo"
        return cls(rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=local_world_size,
                   device=device, backend=backend)

    @classmethod
    def single(cls, device: str = "cpu") -> "World":
        """A one-process world (tune, benchmarks, tests)."""
        backend = "nccl" if device.startswith("cuda") else "gloo"
        return cls(device=device, backend=backend)
