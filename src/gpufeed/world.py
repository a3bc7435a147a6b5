"""One object knows the world: rank, world size, device and backend. Built once, passed in."""

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
        """Read torchrun's RANK / WORLD_SIZE / LOCAL_RANK; pick CUDA when available unless told otherwise."""
        import torch

        rank = int(os.environ.get("RANK", "0"))
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if device is None or device == "auto":
            device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
        elif device == "cuda":
            device = f"cuda:{local_rank}"
        backend = "nccl" if device.startswith("cuda") else "gloo"
        return cls(rank=rank, world_size=world_size, local_rank=local_rank, device=device, backend=backend)

    @classmethod
    def single(cls, device: str = "cpu") -> "World":
        """A one-process world (tune, benchmarks, tests)."""
        backend = "nccl" if device.startswith("cuda") else "gloo"
        return cls(device=device, backend=backend)
