"""``gpufeed doctor``: one table of machine checks, each ok / warn / fail with its evidence and its fix.

:func:`gather_facts` reads the machine once into a :class:`Facts` record (versions, NVML GPUs, CPUs, memory,
/dev/shm, open-file limit, mounts, data paths, environment); every check is a pure function of that record and
returns a :class:`Check`, so tests inject facts. torch and pynvml are imported inside :func:`gather_facts` only.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

from gpufeed.config import LoaderConfig
from gpufeed.loader.ring import buffers_per_worker
from gpufeed.measure.nvml import BENIGN_THROTTLE, decode_reasons, get, power_limit_w, read_reasons
from gpufeed.core.system import mount_of
from gpufeed.core.system import mounts as system_mounts

Status = Literal["ok", "warn", "fail"]

NETWORK_FS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "glusterfs", "ceph",
                        "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.goofys", "fuse.rclone", "9p", "afs"})
"""Filesystem types read over the network: a loader reading shards there is bound by the network."""
RAM_FS = frozenset({"tmpfs", "ramfs"})
PSEUDO_FS = frozenset({"proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs",
                       "securityfs", "configfs", "pstore", "bpf", "mqueue", "efivarfs", "fusectl", "binfmt_misc"})
"""Kernel file systems that hold no data set (a path there is refused by ``doctor``), as are paths under
``/proc``, ``/sys`` and ``/dev`` (but ``/dev/shm``, a RAM disk for staged sets)."""
DATA_FILE_TYPES = ("directory", "regular file")
"""What a data path may be: a shard-set folder, or a file (its ``manifest.json``)."""
MIN_NOFILE = 4096
"""Below this soft RLIMIT_NOFILE a DataLoader with many workers (file-descriptor sharing) can fail."""
MIN_CORES_PER_GPU = 4
"""Fewer usable cores per GPU than this rarely feed an ImageNet-style ResNet loader (decode is CPU work)."""
SWAP_WARN_BYTES = 256 << 20
ENV_PREFIXES = ("NCCL_",)
ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    evidence: str
    fix: str = ""


@dataclass(frozen=True)
class DoctorReport:
    checks: list[Check]
    ok: bool
    """False when any check failed (exit 1); warnings keep it true."""


@dataclass(frozen=True)
class GpuFacts:
    index: int
    name: str
    memory_bytes: int | None = None
    compute_capability: tuple[int, int] | None = None
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    temp_c: int | None = None
    power_limit_w: float | None = None
    sm_clock_mhz: int | None = None
    sm_clock_max_mhz: int | None = None
    throttle_reasons: tuple[str, ...] = ()
    ecc_uncorrected: int | None = None
    """Volatile (since boot) uncorrected ECC errors; None where ECC is off or unsupported."""
    persistence: bool | None = None
    mig: bool | None = None


@dataclass(frozen=True)
class PathFacts:
    path: str
    exists: bool
    fs_type: str = "unknown"
    mount: str = ""
    source: str = ""
    """The mounted device (``/dev/nvme0n1p2``, ``server:/export``)."""
    free_bytes: int | None = None
    set_bytes: int | None = None
    """Total bytes of the shard set from its manifest (of the shards staged there, for a set staged for one node);
    None when the path holds no readable manifest."""
    manifest_error: str | None = None
    file_type: str = "directory"
    """What the path is (:func:`_file_type`): ``directory``, ``regular file``, ``FIFO``, ``character device``..."""


@dataclass(frozen=True)
class Facts:
    versions: dict[str, str | None] = field(default_factory=dict)
    """python, gpufeed, torch, torchvision, webdataset, cuda (torch's runtime), cudnn, nccl, driver."""
    torch_error: str | None = None
    driver_cuda: str | None = None
    """The newest CUDA version the driver supports (NVML), as ``"12.4"``."""
    nvml_error: str | None = None
    gpus: list[GpuFacts] = field(default_factory=list)
    host_cpus: int = 1
    affinity_cpus: int = 1
    cgroup_quota: float | None = None
    usable_cpus: int = 1
    ram_total: int = 0
    ram_available: int = 0
    swap_total: int = 0
    swap_used: int = 0
    shm_total: int | None = None
    shm_free: int | None = None
    nofile_soft: int | None = None
    nofile_hard: int | None = None
    paths: list[PathFacts] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


# --------------------------------------------------------------------------- gathering (the real machine)


def gather_facts(paths: Sequence[str] = ()) -> Facts:
    """Read the machine once. Every probe is guarded: a missing library or file becomes a fact, not an error."""
    import psutil

    from gpufeed import __version__

    from gpufeed.core import system

    versions: dict[str, str | None] = {"python": sys.version.split()[0], "gpufeed": __version__}
    torch_error = None
    try:
        import torch

        versions["torch"] = torch.__version__
        versions["cuda"] = torch.version.cuda
        versions["cudnn"] = _cudnn(torch)
        versions["nccl"] = _nccl(torch)
    except Exception as exc:  # noqa: BLE001 - a broken torch install is a finding
        torch_error = f"{type(exc).__name__}: {exc}".splitlines()[0]
    for mod in ("torchvision", "webdataset"):
        try:
            versions[mod] = getattr(__import__(mod), "__version__", "unknown")
        except Exception:  # noqa: BLE001
            versions[mod] = None
    driver, driver_cuda, gpus, nvml_error = _nvml()
    versions["driver"] = driver
    host = int(psutil.cpu_count(logical=True) or 1)  # host-wide, shown next to what this process may use
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = host
    vm, sw = psutil.virtual_memory(), psutil.swap_memory()
    shm_total = shm_free = None
    try:
        st = os.statvfs("/dev/shm")
        shm_total, shm_free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    except OSError:
        pass
    nofile: tuple[int | None, int | None] = (None, None)
    try:
        import resource

        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        pass
    mounts = system_mounts()
    env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}
    return Facts(
        versions=versions, torch_error=torch_error, driver_cuda=driver_cuda, nvml_error=nvml_error, gpus=gpus,
        host_cpus=host, affinity_cpus=affinity, cgroup_quota=system.cgroup_cpu_quota(),
        usable_cpus=system.usable_cpus(), ram_total=int(vm.total), ram_available=int(vm.available),
        swap_total=int(sw.total), swap_used=int(sw.used), shm_total=shm_total, shm_free=shm_free,
        nofile_soft=_limit(nofile[0]), nofile_hard=_limit(nofile[1]),
        paths=[_path_facts(p, mounts) for p in paths], env=dict(sorted(env.items())))


def _limit(value: int | None) -> int | None:
    import resource

    return None if value is None or value == resource.RLIM_INFINITY else int(value)


def _cudnn(torch: Any) -> str | None:
    if not torch.backends.cudnn.is_available():
        return None
    v = torch.backends.cudnn.version()  # e.g. 90100 (9.1.0) or 8902 (8.9.2)
    if v is None:
        return None
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v >= 10000 else f"{v // 1000}.{v // 100 % 10}.{v % 100}"


def _nccl(torch: Any) -> str | None:
    try:
        v = torch.cuda.nccl.version()
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:  # noqa: BLE001 - a build without NCCL
        return None


def _nvml() -> tuple[str | None, str | None, list[GpuFacts], str | None]:
    """(driver version, driver's CUDA version, GPUs, error) from NVML; no GPU or no NVML gives an error text."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - no driver, no library, no GPU
        return None, None, [], f"{type(exc).__name__}: {exc}".splitlines()[0]
    n = pynvml
    try:
        driver = get(n.nvmlSystemGetDriverVersion)
        cuda = get(n.nvmlSystemGetCudaDriverVersion_v2) or get(n.nvmlSystemGetCudaDriverVersion)
        driver_cuda = f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) and cuda > 0 else None
        gpus = []
        for i in range(get(n.nvmlDeviceGetCount) or 0):
            h = n.nvmlDeviceGetHandleByIndex(i)
            mem = get(lambda: n.nvmlDeviceGetMemoryInfo(h).total)
            cc = get(lambda: n.nvmlDeviceGetCudaComputeCapability(h))
            mig = get(lambda: n.nvmlDeviceGetMigMode(h))
            ecc_on = get(lambda: n.nvmlDeviceGetEccMode(h))
            gpus.append(GpuFacts(
                index=i, name=str(get(lambda: n.nvmlDeviceGetName(h)) or "unknown"),
                memory_bytes=int(mem) if mem is not None else None,
                compute_capability=tuple(cc) if cc else None,  # type: ignore[arg-type]
                pcie_gen=get(lambda: n.nvmlDeviceGetCurrPcieLinkGeneration(h)),
                pcie_gen_max=get(lambda: n.nvmlDeviceGetMaxPcieLinkGeneration(h)),
                pcie_width=get(lambda: n.nvmlDeviceGetCurrPcieLinkWidth(h)),
                pcie_width_max=get(lambda: n.nvmlDeviceGetMaxPcieLinkWidth(h)),
                temp_c=get(lambda: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)),
                power_limit_w=power_limit_w(n, h),
                sm_clock_mhz=get(lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)),
                sm_clock_max_mhz=get(lambda: n.nvmlDeviceGetMaxClockInfo(h, n.NVML_CLOCK_SM)),
                throttle_reasons=decode_reasons(read_reasons(n, h)),
                ecc_uncorrected=get(lambda: n.nvmlDeviceGetTotalEccErrors(
                    h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC)) if ecc_on and ecc_on[0] else None,
                persistence=None if (p := get(lambda: n.nvmlDeviceGetPersistenceMode(h))) is None else bool(p),
                mig=None if not mig else bool(mig[0])))
        return driver, driver_cuda, gpus, None
    finally:
        get(n.nvmlShutdown)


def _path_facts(path: str, mounts: list[tuple[str, str, str]]) -> PathFacts:
    from gpufeed.core.errors import GpufeedError
    from gpufeed.shardset.manifest import manifest_path, read_manifest
    from gpufeed.shardset.manifest import staged_node
    from gpufeed.core.world import node_shards

    if not os.path.exists(path):
        return PathFacts(path=path, exists=False)
    real = os.path.realpath(path)
    source, mount, fs_type = mount_of(real, mounts)
    kind = _file_type(os.stat(real).st_mode)
    if kind not in DATA_FILE_TYPES or pseudo_path(real, fs_type):  # nothing there to open or read (a FIFO blocks)
        return PathFacts(path=path, exists=True, fs_type=fs_type, mount=mount, source=source, file_type=kind)
    try:
        st = os.statvfs(real)
        free: int | None = st.f_bavail * st.f_frsize
    except OSError:
        free = None
    set_bytes = error = None
    if manifest_path(path).exists():
        try:
            m = read_manifest(path)
            set_bytes = m.total_bytes
            staged = staged_node(m, path)
            if staged is not None:  # staged for one node (gpufeed stage --num-nodes): only its shards are here
                set_bytes = sum(m.shards[i].bytes for i in node_shards(len(m.shards), *staged))
        except (GpufeedError, OSError) as exc:
            error = str(exc).splitlines()[0]
    return PathFacts(path=path, exists=True, fs_type=fs_type, mount=mount, source=source, free_bytes=free,
                     set_bytes=set_bytes, manifest_error=error)


def _file_type(mode: int) -> str:
    import stat

    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISREG, "regular file"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


def pseudo_path(real: str, fs_type: str) -> bool:
    """Whether the resolved path ``real`` is on a kernel file system (:data:`PSEUDO_FS`) or under ``/proc``,
    ``/sys`` or ``/dev`` other than ``/dev/shm``: no data set lives there."""
    under = lambda root: real == root or real.startswith(root + "/")  # noqa: E731
    return (fs_type in PSEUDO_FS or under("/proc") or under("/sys")
            or (under("/dev") and not under("/dev/shm")))


# --------------------------------------------------------------------------- checks (pure functions of Facts)


def _gb(n: float | None) -> str:
    return "?" if n is None else f"{n / 1e9:.1f} GB"


def _ver(text: str | None) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in (text or "").split(".")[:2])
    except ValueError:
        return ()


def check_versions(f: Facts) -> Check:
    v = f.versions
    shown = ", ".join(f"{k} {v.get(k) or '-'}" for k in ("python", "torch", "torchvision", "webdataset", "gpufeed",
                                                         "cuda", "cudnn", "nccl", "driver"))
    if f.torch_error:
        return Check("versions", "fail", f"torch does not import ({f.torch_error}); {shown}",
                     "reinstall torch for this Python and CUDA (https://pytorch.org/get-started/locally/)")
    missing = [k for k in ("torch", "torchvision", "webdataset") if not v.get(k)]
    if missing:
        return Check("versions", "warn", f"{', '.join(missing)} not installed; {shown}",
                     f"pip install {' '.join(missing)}")
    return Check("versions", "ok", shown)


def check_tested(f: Facts) -> Check:
    """A note (warn, never a failure) when the installed torch or torchvision is not the release the test suite
    ran with (``gpufeed.core.tested``, constraints.txt); the local build label (``+cu130``) is ignored."""
    from gpufeed.core.tested import TESTED_VERSIONS, base_version

    tested = ", ".join(f"{k} {v}" for k, v in TESTED_VERSIONS.items())
    differ = [f"{k} {f.versions[k]}" for k, v in TESTED_VERSIONS.items()
              if f.versions.get(k) and base_version(str(f.versions[k])) != v]
    if not differ:
        return Check("tested versions", "ok", f"the versions the test suite ran with: {tested}"
                     if all(f.versions.get(k) for k in TESTED_VERSIONS) else f"tested with {tested}")
    pins = " ".join(f"{k}=={v}" for k, v in TESTED_VERSIONS.items())
    return Check("tested versions", "warn", f"{', '.join(differ)} installed; the test suite ran with {tested} "
                 "(constraints.txt): likely fine, but untested", f"to run what was tested: pip install {pins} from "
                 "the PyTorch index of your CUDA version (constraints.txt in the gpufeed source pins them)")


def check_driver(f: Facts) -> Check:
    runtime = f.versions.get("cuda")
    if not f.gpus:
        return Check("cuda driver", "ok", f"no NVIDIA GPU, nothing to check (torch CUDA runtime {runtime or '-'})")
    if not runtime:
        return Check("cuda driver", "fail", f"{len(f.gpus)} GPU(s) found but torch is a CPU-only build",
                     "install a CUDA build of torch (https://pytorch.org/get-started/locally/)")
    if not f.driver_cuda:
        return Check("cuda driver", "warn", f"the driver's CUDA version is unknown; torch runtime {runtime}",
                     "check nvidia-smi's 'CUDA Version'")
    drv, rt = _ver(f.driver_cuda), _ver(runtime)
    evidence = f"driver {f.versions.get('driver') or '?'} supports CUDA {f.driver_cuda}, torch runtime is {runtime}"
    if drv[:1] < rt[:1]:
        return Check("cuda driver", "fail", f"{evidence}: the driver is too old for the runtime",
                     f"update the NVIDIA driver to one supporting CUDA {runtime}, or install a torch built for "
                     f"CUDA {f.driver_cuda} or older")
    if drv < rt:
        return Check("cuda driver", "warn", f"{evidence}: runs through CUDA minor-version compatibility only "
                     "(PTX JIT and some newer features fail)", f"update the NVIDIA driver to CUDA {runtime} or newer")
    return Check("cuda driver", "ok", evidence)


def check_gpus(f: Facts) -> list[Check]:
    if not f.gpus:
        why = f" ({f.nvml_error})" if f.nvml_error else ""
        return [Check("gpu", "ok", f"no NVIDIA GPU found through NVML{why}: CPU-only machine")]
    out = []
    for g in f.gpus:
        cc = g.compute_capability
        parts = [g.name, _gb(g.memory_bytes),
                 f"cc {cc[0]}.{cc[1]}" if cc else "cc ?",
                 "bf16" if cc and cc >= (8, 0) else "no bf16" if cc else "bf16 ?",
                 f"{g.temp_c} C" if g.temp_c is not None else "temp ?",
                 f"power limit {g.power_limit_w:.0f} W" if g.power_limit_w else "power limit ?",
                 f"SM {g.sm_clock_mhz}/{g.sm_clock_max_mhz} MHz",
                 "persistence " + ("on" if g.persistence else "off" if g.persistence is False else "?"),
                 "MIG on" if g.mig else "MIG off" if g.mig is False else "MIG -"]
        out.append(Check(f"gpu{g.index}", "ok", ", ".join(parts)))
        out.append(_pcie(g))
        slow = [r for r in g.throttle_reasons if r not in BENIGN_THROTTLE]
        if slow:
            out.append(Check(f"gpu{g.index} throttle", "warn", f"clocks held back by {', '.join(slow)} "
                             f"(SM {g.sm_clock_mhz}/{g.sm_clock_max_mhz} MHz, {g.temp_c} C, limit "
                             f"{g.power_limit_w} W)", "check cooling and airflow (thermal) or the power limit "
                             "(nvidia-smi -q -d PERFORMANCE,POWER; nvidia-smi -pl)"))
        else:
            out.append(Check(f"gpu{g.index} throttle", "ok",
                             f"no throttling ({', '.join(g.throttle_reasons) or 'no reasons set'})"))
        if g.ecc_uncorrected:
            out.append(Check(f"gpu{g.index} ecc", "warn", f"{g.ecc_uncorrected} uncorrected ECC errors since boot",
                             "nvidia-smi -q -d ECC,PAGE_RETIREMENT; reset the GPU, and report it if they recur"))
    return out


def _pcie(g: GpuFacts) -> Check:
    name = f"gpu{g.index} pcie"
    if None in (g.pcie_gen, g.pcie_gen_max, g.pcie_width, g.pcie_width_max):
        return Check(name, "ok", "PCIe link not reported (SXM/NVLink board or no NVML support)")
    link = f"gen {g.pcie_gen} x{g.pcie_width} now, gen {g.pcie_gen_max} x{g.pcie_width_max} max"
    if g.pcie_gen < g.pcie_gen_max or g.pcie_width < g.pcie_width_max:  # type: ignore[operator]
        return Check(name, "warn", f"{link}: the link runs below its maximum (an idle GPU may lower its generation "
                     "to save power: recheck under load; a narrower width does not recover)",
                     "reseat the GPU in a x16 slot, check the BIOS PCIe setting and riser cables; "
                     "nvidia-smi -q -d PCIE under load")
    return Check(name, "ok", link)


def check_cpus(f: Facts) -> Check:
    quota = f" cgroup quota {f.cgroup_quota:g} CPUs," if f.cgroup_quota is not None else " no cgroup quota,"
    per_gpu = f.usable_cpus / len(f.gpus) if f.gpus else None
    evidence = (f"usable cores {f.usable_cpus} (host {f.host_cpus}, affinity {f.affinity_cpus},{quota[:-1]})"
                + (f", {per_gpu:g} per GPU" if per_gpu is not None else ""))
    if per_gpu is not None and per_gpu < MIN_CORES_PER_GPU:
        return Check("cpu", "warn", f"{evidence}: too few cores per GPU to decode images fast enough",
                     "ask the scheduler for more CPUs per GPU (--cpus-per-gpu, docker --cpus), or use gpufeed "
                     "tune to find what these cores deliver")
    return Check("cpu", "ok", evidence)


def shm_need(cfg: LoaderConfig) -> int:
    """Bytes of /dev/shm one rank's loader holds: num_workers x the batches each holds (its ``prefetch_factor`` in
    flight, and the buffers it reuses with persistent workers: :func:`gpufeed.loader.ring.buffers_per_worker`) x batch
    x S x S x 3 (uint8)."""
    return cfg.num_workers * buffers_per_worker(cfg) * cfg.batch_size * cfg.image_size * cfg.image_size * 3


def _held(cfg: LoaderConfig) -> str:
    n = buffers_per_worker(cfg)
    return f"{n} batches ({cfg.prefetch_factor} prefetch + {n - cfg.prefetch_factor} reused)" \
        if n != cfg.prefetch_factor else f"{n} prefetch"


def check_memory(f: Facts) -> Check:
    evidence = f"RAM {_gb(f.ram_total)}, {_gb(f.ram_available)} available; swap {_gb(f.swap_used)} used of " \
               f"{_gb(f.swap_total)}"
    if f.swap_used > SWAP_WARN_BYTES:
        return Check("memory", "warn", f"{evidence}: the machine is swapping, which stalls loader workers",
                     "lower num_workers or prefetch_factor, or free memory")
    return Check("memory", "ok", evidence)


def check_shm(f: Facts, cfg: LoaderConfig) -> Check:
    ranks = max(1, len(f.gpus))
    per_rank = shm_need(cfg)
    need = per_rank * ranks
    formula = (f"{cfg.num_workers} workers x {_held(cfg)} x {cfg.batch_size} batch x "
               f"{cfg.image_size}x{cfg.image_size}x3 B = {_gb(per_rank)} per rank x {ranks} rank(s) = {_gb(need)}")
    fix = ("give the container more: docker run --shm-size=" + f"{max(1, -(-need * 2 // (1 << 30)))}g"
           " (Kubernetes: an emptyDir with medium: Memory on /dev/shm), or lower num_workers / prefetch_factor")
    if f.shm_total is None:
        return Check("/dev/shm", "warn", f"/dev/shm is missing; the loader needs {formula}", fix)
    evidence = f"/dev/shm {_gb(f.shm_total)} ({_gb(f.shm_free)} free); the loader needs {formula}"
    if need > f.shm_total:
        return Check("/dev/shm", "fail", f"{evidence}: too small, workers will die with a bus error", fix)
    if f.shm_free is not None and need > f.shm_free:
        return Check("/dev/shm", "warn", f"{evidence}: not enough free now", "free /dev/shm (old shard copies?), "
                     "or " + fix)
    return Check("/dev/shm", "ok", evidence)


def check_nofile(f: Facts) -> Check:
    if f.nofile_soft is None:
        return Check("open files", "ok", "no open-file limit")
    evidence = f"open-file limit {f.nofile_soft} (hard {f.nofile_hard if f.nofile_hard is not None else 'unlimited'})"
    if f.nofile_soft < MIN_NOFILE:
        return Check("open files", "warn", f"{evidence}: DataLoader workers can run out of descriptors",
                     f"ulimit -n {f.nofile_hard if f.nofile_hard is not None else 65536} before running "
                     "(docker: --ulimit nofile=65536:65536)")
    return Check("open files", "ok", evidence)


def check_path(p: PathFacts, f: Facts) -> list[Check]:
    name = f"data {p.path}"
    if not p.exists:
        return [Check(name, "fail", f"{p.path} does not exist", "check the path")]
    if p.file_type not in DATA_FILE_TYPES:
        return [Check(name, "fail", f"{p.path} is a {p.file_type}, not a shard-set folder or file",
                      "give the folder of a shard set (or its manifest.json)")]
    if pseudo_path(p.path, p.fs_type):
        return [Check(name, "fail", f"{p.path} is on {p.fs_type} ({p.mount or '?'}), a kernel file system, not "
                      f"storage that holds data", "give the folder of a shard set")]
    if p.fs_type in RAM_FS:
        kind = "RAM disk"
    elif p.fs_type in NETWORK_FS or p.fs_type.startswith("fuse."):
        kind = "network storage"
    elif "nvme" in p.source:
        kind = "NVMe"
    else:
        kind = "local disk"
    evidence = f"{p.fs_type} on {p.mount or '?'} ({p.source or '?'}), {kind}, {_gb(p.free_bytes)} free"
    out = []
    if kind == "network storage":
        out.append(Check(name, "warn", f"{evidence}: network storage bounds the loader by the network",
                         f"copy it to local NVMe or /dev/shm with gpufeed stage {p.path} DEST, and measure with "
                         "gpufeed io"))
    else:
        out.append(Check(name, "ok", evidence))
    if p.manifest_error:
        out.append(Check(f"{name} set", "warn", f"manifest unreadable: {p.manifest_error}",
                         f"gpufeed verify {p.path}"))
    elif p.set_bytes is not None:
        fits = f"shard set {_gb(p.set_bytes)}, RAM {_gb(f.ram_total)} ({_gb(f.ram_available)} available)"
        if kind != "RAM disk" and p.set_bytes > f.ram_available:
            out.append(Check(f"{name} set", "warn", f"{fits}: it does not fit the page cache, so every epoch "
                             "reads it from storage", "make sure storage delivers the rate (gpufeed io), or use a "
                             "machine with more RAM"))
        else:
            out.append(Check(f"{name} set", "ok", f"{fits}: fits the page cache after the first epoch"
                             if kind != "RAM disk" else f"{fits}: already in RAM"))
    return out


MAX_OMP_THREADS = 4096
"""Most threads ``OMP_NUM_THREADS`` may ask for (and never more than 64 per usable core)."""


def omp_threads_problem(value: str, cpus: int = 1) -> str | None:
    """Why an ``OMP_NUM_THREADS`` value is not a thread count (None when it is): a positive integer, or a comma
    list of them (one per nesting level), each at most ``MAX_OMP_THREADS`` and 64 per usable core (``cpus``)."""
    parts = value.strip().split(",")
    if not all(x.strip().isascii() and x.strip().isdigit() and x.strip().strip("0") for x in parts):
        return "it is not a positive whole number of threads (OpenMP ignores it or fails, and torch warns)"
    most = min(MAX_OMP_THREADS, 64 * max(1, cpus))
    if any(len(x.strip()) > 9 or int(x) > most for x in parts):  # no int() of a 5,000-digit string
        return f"it is not a usable thread count (more than {most}: {MAX_OMP_THREADS} at most, 64 per usable core)"
    return None


def check_env(f: Facts) -> Check:
    omp = f.env.get("OMP_NUM_THREADS")
    why = None if omp is None else omp_threads_problem(omp, f.usable_cpus)
    if why:
        return Check("environment", "fail", f"OMP_NUM_THREADS={omp[:40]!r}: {why}",
                     "unset OMP_NUM_THREADS or set it to a positive integer (e.g. 1 per loader worker)")
    if not f.env:
        return Check("environment", "ok", "no NCCL_*, CUDA_VISIBLE_DEVICES or OMP_NUM_THREADS set")
    shown = ", ".join(f"{k}={v}" for k, v in f.env.items())
    if f.env.get("CUDA_VISIBLE_DEVICES", None) == "" and f.gpus:
        return Check("environment", "warn", f"{shown}: CUDA_VISIBLE_DEVICES is empty, so torch sees no GPU",
                     "unset CUDA_VISIBLE_DEVICES or list the GPUs to use")
    return Check("environment", "ok", shown)


def run_checks(f: Facts, cfg: LoaderConfig) -> DoctorReport:
    checks = [check_versions(f), check_tested(f), check_driver(f), *check_gpus(f), check_cpus(f), check_memory(f), check_shm(f, cfg),
              check_nofile(f)]
    for p in f.paths:
        checks.extend(check_path(p, f))
    checks.append(check_env(f))
    return DoctorReport(checks=checks, ok=all(c.status != "fail" for c in checks))


def doctor(paths: list[str], loader_cfg: LoaderConfig) -> DoctorReport:
    """Gather the machine's facts once and run every check."""
    return run_checks(gather_facts(paths), loader_cfg)


def render(report: DoctorReport) -> str:
    width = max((len(c.name) for c in report.checks), default=0)
    lines = []
    for c in report.checks:
        lines.append(f"{c.status:<4}  {c.name:<{width}}  {c.evidence}")
        if c.fix and c.status != "ok":
            lines.append(f"{'':<4}  {'':<{width}}  fix: {c.fix}")
    fails = sum(c.status == "fail" for c in report.checks)
    warns = sum(c.status == "warn" for c in report.checks)
    lines.append(f"{fails} failed, {warns} warnings, {len(report.checks) - fails - warns} ok")
    return "\n".join(lines)


__all__ = ["Check", "DoctorReport", "Facts", "GpuFacts", "PathFacts", "check_tested", "doctor", "gather_facts",
           "render", "run_checks", "shm_need"]
