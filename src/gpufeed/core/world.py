"""One object knows the world: rank, world size, node, ranks per node, device and backend. Built once, passed in."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping


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


def _env_int(name: str, default: int, environ: Mapping[str, str] | None = None) -> int:
    """The launcher variable ``name`` as a non-negative integer (at most 9 digits), ``default`` when unset; anything
    else is a ConfigError naming it (one sentence, not a traceback)."""
    from gpufeed.core.errors import ConfigError

    raw = (os.environ if environ is None else environ).get(name)
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


RENDEZVOUS_TIMEOUT_S = 300.0
"""How long a rank waits for rank 0's store to answer and for every rank to join (:func:`join`);
``GPUFEED_RENDEZVOUS_TIMEOUT_S`` overrides it."""
RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
"""Variables that make this process one rank of a world; torchrun sets them together with MASTER_ADDR/PORT."""
MAX_NAMED_RANKS = 8
"""Missing ranks a rendezvous error names (then ``and N more``)."""


def check_launch_env(environ: Mapping[str, str] | None = None) -> None:
    """Refuse an inconsistent launch environment before any rendezvous (ConfigError, exit 2), naming what is
    wrong or missing: once any of :data:`RANK_ENV` is set, RANK and WORLD_SIZE must both be, as non-negative
    integers, with RANK < WORLD_SIZE and LOCAL_RANK < LOCAL_WORLD_SIZE (when given) and < WORLD_SIZE; a world of more
    than one rank needs MASTER_ADDR and MASTER_PORT (1..65535), where rank 0's store listens. Without any of
    :data:`RANK_ENV` this is one process (MASTER_ADDR/PORT alone are not used)."""
    from gpufeed.core.errors import ConfigError

    env = os.environ if environ is None else environ
    given = [n for n in RANK_ENV if n in env]
    if not given:
        return
    fix = ("torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT together; for one process "
           "unset them")
    values = {n: _env_int(n, -1, env) for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    rank, world_size, local_rank, local_ws = (values[n] for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                    "LOCAL_WORLD_SIZE"))
    if world_size == 0:
        raise ConfigError(f"environment variable WORLD_SIZE=0: a world has at least one rank ({fix})")
    if rank >= 0 and world_size > 0 and rank >= world_size:
        raise ConfigError(f"environment variable RANK={rank} is not below WORLD_SIZE={world_size}: ranks are "
                          f"0..{world_size - 1}")
    if local_ws == 0:
        raise ConfigError(f"environment variable LOCAL_WORLD_SIZE=0: a node runs at least one rank ({fix})")
    if local_rank >= 0 and local_ws > 0 and local_rank >= local_ws:
        raise ConfigError(f"environment variable LOCAL_RANK={local_rank} is not below LOCAL_WORLD_SIZE={local_ws}")
    if local_rank >= 0 and world_size > 0 and local_rank >= world_size:
        raise ConfigError(f"environment variable LOCAL_RANK={local_rank} is not below WORLD_SIZE={world_size}")
    missing = [n for n in ("RANK", "WORLD_SIZE") if n not in env]
    if world_size != 1:
        missing += [n for n in ("MASTER_ADDR", "MASTER_PORT") if not env.get(n, "").strip()]
    if missing:
        raise ConfigError(f"launch environment: {', '.join(given)} {'is' if len(given) == 1 else 'are'} set but "
                          f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not ({fix})")
    if world_size > 1 and not 1 <= _env_int("MASTER_PORT", 0, env) <= 65535:
        raise ConfigError(f"environment variable MASTER_PORT={env['MASTER_PORT'][:40]!r} is not a port (1..65535)")


def rendezvous_timeout_s(environ: Mapping[str, str] | None = None) -> float:
    """:data:`RENDEZVOUS_TIMEOUT_S`, or ``GPUFEED_RENDEZVOUS_TIMEOUT_S`` (seconds, in (0, 86400])."""
    from gpufeed.core.errors import ConfigError

    raw = (os.environ if environ is None else environ).get("GPUFEED_RENDEZVOUS_TIMEOUT_S", "")
    if not raw:
        return RENDEZVOUS_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 86400:
        raise ConfigError(f"environment variable GPUFEED_RENDEZVOUS_TIMEOUT_S={raw[:40]!r} is not a number of "
                          f"seconds in (0, 86400]")
    return value


STORE_GRACE_S = 5.0
"""Seconds past the rendezvous bound that the store's constructor gets before the wait is abandoned (torch's own
timeout covers a store that answers; its first handshake with a port that accepts and then says nothing has none)."""


def _within(seconds: float, make: Callable[[], Any]) -> Any:
    """``make()`` run in a daemon thread, waited on for at most ``seconds``: its result, its exception, or
    TimeoutError (the thread is left blocked; it dies with the process)."""
    import threading

    out: list[Any] = []

    def run() -> None:
        try:
            out.append((True, make()))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            out.append((False, exc))

    t = threading.Thread(target=run, name="gpufeed-rendezvous", daemon=True)
    t.start()
    t.join(seconds)
    if not out:
        raise TimeoutError(f"no answer within {seconds:g} s")
    ok, value = out[0]
    if not ok:
        raise value
    return value


def join(world: World, environ: Mapping[str, str] | None = None) -> Any:
    """Rendezvous of ``world`` through the TCPStore at MASTER_ADDR:MASTER_PORT, every wait bounded by
    :func:`rendezvous_timeout_s`; returns the store for ``init_process_group(store=...)``.

    Rank 0 serves the store, unless torchrun's agent already does (``TORCHELASTIC_USE_AGENT_STORE``). Each rank
    registers itself and waits until all ``world_size`` have; past the bound it raises a RunError naming the
    ranks that did not come (a rank that cannot reach the store names rank 0 and the address)."""
    from datetime import timedelta

    import torch.distributed as dist

    from gpufeed.core.errors import RunError, one_line

    env = os.environ if environ is None else environ
    check_launch_env(env)
    bound = rendezvous_timeout_s(env)
    host, port = env["MASTER_ADDR"].strip(), _env_int("MASTER_PORT", 0, env)
    where = f"{host[:100]}:{port}"
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent serves MASTER_ADDR:MASTER_PORT
    serve = world.rank == 0 and not agent
    deadline = time.perf_counter() + bound
    try:
        store = _within(bound + STORE_GRACE_S, lambda: dist.TCPStore(
            host, port, world.world_size, is_master=serve, timeout=timedelta(seconds=bound), wait_for_workers=False,
            multi_tenant=True))
    except (RuntimeError, ValueError, OSError, TimeoutError) as exc:  # torch's DistNetworkError/DistStoreError are RuntimeErrors
        if serve:
            raise RunError(f"rendezvous: rank 0 cannot serve the store at {where} ({one_line(exc)[:160]})") from None
        server = "torchrun's agent" if agent else "rank 0"
        raise RunError(f"rendezvous: rank {world.rank} could not reach the store at {where} within {bound:g} s: "
                       f"{server} did not come ({one_line(exc)[:120]})") from None
    prefix = f"gpufeed/join/{env.get('TORCHELASTIC_RUN_ID', '')[:64]}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')[:9]}"
    try:
        store.set(f"{prefix}/rank/{world.rank}", "1")
        joined = store.add(f"{prefix}/count", 1)
        while joined < world.world_size:
            if time.perf_counter() >= deadline:
                missing: list[int] = []
                for r in range(world.world_size):
                    if not store.check([f"{prefix}/rank/{r}"]):
                        missing.append(r)
                        if len(missing) > MAX_NAMED_RANKS:
                            break
                named = ", ".join(map(str, missing[:MAX_NAMED_RANKS]))
                extra = world.world_size - joined - MAX_NAMED_RANKS
                more = f" and {extra} more" if len(missing) > MAX_NAMED_RANKS else ""
                raise RunError(f"rendezvous: rank{'s' if len(missing) > 1 else ''} {named}{more} of {world.world_size} "
                               f"did not join within {bound:g} s (rank {world.rank} waited at {where})")
            time.sleep(0.1)
            joined = store.add(f"{prefix}/count", 0)
    except RuntimeError as exc:  # the store went away (rank 0 died) or an operation timed out
        raise RunError(f"rendezvous: the store at {where} stopped answering rank {world.rank} "
                       f"({one_line(exc)[:120]})") from None
    return store
