"""gpufeed doctor: each check is a pure function of injected Facts; the CLI runs on this GPU-less machine."""

from __future__ import annotations

import os
import subprocess
import sys

from gpufeed import doctor as d
from gpufeed.config import LoaderConfig
from tests.common.cli import invoke_json

GB = 10**9
V = {"python": "3.11.7", "gpufeed": "0.1.0", "torch": "2.4.0", "torchvision": "0.19.0", "webdataset": "0.2.100",
     "cuda": "12.4", "cudnn": "9.1.0", "nccl": "2.20.5", "driver": "550.54"}


def facts(**kw: object) -> d.Facts:
    base = dict(versions=V, host_cpus=16, affinity_cpus=16, usable_cpus=16, ram_total=64 * GB,
                ram_available=60 * GB, shm_total=32 * GB, shm_free=32 * GB, nofile_soft=65536, nofile_hard=65536)
    base.update(kw)
    return d.Facts(**base)  # type: ignore[arg-type]


def gpu(**kw: object) -> d.GpuFacts:
    base = dict(index=0, name="NVIDIA A100", memory_bytes=80 * GB, compute_capability=(8, 0), pcie_gen=4,
                pcie_gen_max=4, pcie_width=16, pcie_width_max=16, temp_c=40, power_limit_w=400.0, sm_clock_mhz=1410,
                sm_clock_max_mhz=1410)
    base.update(kw)
    return d.GpuFacts(**base)  # type: ignore[arg-type]


def by_name(report: d.DoctorReport) -> dict[str, d.Check]:
    return {c.name: c for c in report.checks}


def test_no_gpu_is_ok_and_says_so() -> None:
    report = d.run_checks(facts(nvml_error="NVMLError_LibraryNotFound"), LoaderConfig())
    checks = by_name(report)
    assert checks["gpu"].status == "ok" and "no NVIDIA GPU" in checks["gpu"].evidence
    assert report.ok


def test_cli_json_on_this_machine_has_a_stable_schema(tmp_path) -> None:
    obj = invoke_json(["doctor", str(tmp_path)])
    assert set(obj) == {"checks", "ok"} and obj["ok"] is True
    assert all(set(c) == {"name", "status", "evidence", "fix"} for c in obj["checks"])
    assert all(c["status"] in ("ok", "warn", "fail") for c in obj["checks"])
    names = [c["name"] for c in obj["checks"]]
    assert {"versions", "cuda driver", "cpu", "memory", "/dev/shm", "open files", f"data {tmp_path}",
            "environment"} <= set(names)
    if not any(n.startswith("gpu") and n != "gpu" for n in names):  # this machine has no GPU
        assert "no NVIDIA GPU" in next(c for c in obj["checks"] if c["name"] == "gpu")["evidence"]


def test_cli_missing_data_path_fails_with_exit_1(tmp_path) -> None:
    obj = invoke_json(["doctor", str(tmp_path / "nope")], expect=1)
    assert obj["ok"] is False
    assert next(c for c in obj["checks"] if c["name"] == f"data {tmp_path / 'nope'}")["status"] == "fail"


def test_shm_too_small_fails_with_the_formula_and_docker_fix() -> None:
    cfg = LoaderConfig(num_workers=8, prefetch_factor=2, batch_size=256, image_size=224, persistent_workers=False)
    assert d.shm_need(cfg) == 8 * 2 * 256 * 224 * 224 * 3  # ~ 616 MB
    report = d.run_checks(facts(shm_total=64 << 20, shm_free=64 << 20,
                                gpus=[gpu(index=0), gpu(index=1)]), cfg)  # 2 ranks: ~1.2 GB
    c = by_name(report)["/dev/shm"]
    assert c.status == "fail" and not report.ok
    assert "8 workers x 2 prefetch x 256 batch x 224x224x3 B" in c.evidence and "x 2 rank(s) = 1.2 GB" in c.evidence
    assert "--shm-size=3g" in c.fix


def test_shm_counts_the_batch_buffers_persistent_workers_reuse() -> None:
    """With persistent workers each worker keeps its reused batch buffers (loader/ring.py): prefetch_factor + 3."""
    cfg = LoaderConfig(num_workers=8, prefetch_factor=2, batch_size=256, image_size=224, persistent_workers=True)
    assert d.shm_need(cfg) == 8 * 5 * 256 * 224 * 224 * 3  # ~ 1.5 GB
    c = by_name(d.run_checks(facts(shm_total=1 << 30, shm_free=1 << 30, gpus=[gpu(index=0)]), cfg))["/dev/shm"]
    assert c.status == "fail" and "8 workers x 5 batches (2 prefetch + 3 reused) x 256 batch" in c.evidence
    ok = d.run_checks(facts(shm_total=2 << 30, shm_free=2 << 30, gpus=[gpu()]), cfg)
    assert by_name(ok)["/dev/shm"].status == "ok"


def test_cgroup_quota_of_2_on_a_64_core_host(monkeypatch) -> None:
    from gpufeed.core import system

    import psutil

    monkeypatch.setattr(system, "cgroup_cpu_quota", lambda: 2.0)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 64)
    f = d.gather_facts([])
    assert (f.usable_cpus, f.affinity_cpus, f.host_cpus, f.cgroup_quota) == (2, 64, 64, 2.0)
    c = by_name(d.run_checks(f, LoaderConfig()))["cpu"]
    assert c.evidence.startswith("usable cores 2 (host 64, affinity 64, cgroup quota 2 CPUs)")
    c = by_name(d.run_checks(facts(usable_cpus=2, cgroup_quota=2.0, host_cpus=64, affinity_cpus=64, gpus=[gpu()]),
                             LoaderConfig()))["cpu"]
    assert c.status == "warn" and "2 per GPU" in c.evidence


def test_pcie_trained_down_warns_naming_both_links() -> None:
    c = by_name(d.run_checks(facts(gpus=[gpu(pcie_gen=1, pcie_width=4)]), LoaderConfig()))["gpu0 pcie"]
    assert c.status == "warn"
    assert "gen 1 x4 now, gen 4 x16 max" in c.evidence
    assert by_name(d.run_checks(facts(gpus=[gpu()]), LoaderConfig()))["gpu0 pcie"].status == "ok"


def test_throttle_reasons_warn_but_idle_does_not() -> None:
    f = facts(gpus=[gpu(throttle_reasons=("sw_power_cap", "hw_thermal_slowdown"))])
    c = by_name(d.run_checks(f, LoaderConfig()))["gpu0 throttle"]
    assert c.status == "warn" and "sw_power_cap, hw_thermal_slowdown" in c.evidence
    idle = by_name(d.run_checks(facts(gpus=[gpu(throttle_reasons=("gpu_idle",))]), LoaderConfig()))
    assert idle["gpu0 throttle"].status == "ok"


def test_old_driver_fails() -> None:
    report = d.run_checks(facts(gpus=[gpu()], driver_cuda="11.8"), LoaderConfig())
    c = by_name(report)["cuda driver"]
    assert c.status == "fail" and not report.ok
    assert "supports CUDA 11.8, torch runtime is 12.4" in c.evidence
    assert by_name(d.run_checks(facts(gpus=[gpu()], driver_cuda="12.4"), LoaderConfig()))["cuda driver"].status == "ok"


def test_data_on_nfs_warns_network_storage() -> None:
    p = d.PathFacts(path="/data/set", exists=True, fs_type="nfs4", mount="/data", source="filer:/export",
                    free_bytes=GB)
    c = by_name(d.run_checks(facts(paths=[p]), LoaderConfig()))["data /data/set"]
    assert c.status == "warn" and "network storage" in c.evidence and "gpufeed stage" in c.fix


def test_nvme_path_and_mount_parsing(tmp_path) -> None:
    mounts = [("/dev/vda1", "/", "ext4"), ("/dev/nvme0n1p1", str(tmp_path), "xfs")]
    p = d._path_facts(str(tmp_path), mounts)
    assert (p.fs_type, p.mount, p.source) == ("xfs", str(tmp_path), "/dev/nvme0n1p1")
    assert "NVMe" in by_name(d.run_checks(facts(paths=[p]), LoaderConfig()))[f"data {tmp_path}"].evidence


def test_shard_set_larger_than_ram_warns_page_cache() -> None:
    p = d.PathFacts(path="/nvme/set", exists=True, fs_type="xfs", mount="/nvme", source="/dev/nvme0n1",
                    free_bytes=GB, set_bytes=100 * GB)
    c = by_name(d.run_checks(facts(paths=[p]), LoaderConfig()))["data /nvme/set set"]
    assert c.status == "warn" and "does not fit the page cache" in c.evidence and "100.0 GB" in c.evidence
    small = d.PathFacts(path="/nvme/set", exists=True, fs_type="xfs", set_bytes=10 * GB)
    assert by_name(d.run_checks(facts(paths=[small]), LoaderConfig()))["data /nvme/set set"].status == "ok"


def test_manifest_size_is_read_from_a_real_shard_set(tmp_path) -> None:
    from gpufeed.shardset.manifest import Manifest, ShardInfo, write_manifest

    (tmp_path / "train-000000.tar").write_bytes(b"\0" * 10240)
    write_manifest(tmp_path, Manifest(prefix="train", classes=["a"], num_samples=1, total_bytes=10240,
                                      shards=[ShardInfo("train-000000.tar", 1, 10240, None)]))
    assert d._path_facts(str(tmp_path), []).set_bytes == 10240
    (tmp_path / "manifest.json").write_text("{not json")
    bad = d._path_facts(str(tmp_path), [])
    assert bad.set_bytes is None and bad.manifest_error
    assert by_name(d.run_checks(facts(paths=[bad]), LoaderConfig()))[f"data {tmp_path} set"].status == "warn"


def test_help_stays_torch_free() -> None:
    code = ("import sys; from gpufeed.cli import cli\n"
            "try:\n    cli(['--help'])\nexcept SystemExit: pass\n"
            "assert 'torch' not in sys.modules and 'gpufeed.doctor' not in sys.modules\n"
            "import gpufeed.doctor\nassert 'torch' not in sys.modules\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
    assert out.returncode == 0, out.stderr
    assert "gpufeed doctor" in out.stdout


def test_env_lists_nccl_and_cuda_visible_devices() -> None:
    f = facts(env={"NCCL_IB_DISABLE": "1", "CUDA_VISIBLE_DEVICES": "0,1"})
    c = by_name(d.run_checks(f, LoaderConfig()))["environment"]
    assert c.status == "ok" and c.evidence == "NCCL_IB_DISABLE=1, CUDA_VISIBLE_DEVICES=0,1"
    c = by_name(d.run_checks(facts(env={"CUDA_VISIBLE_DEVICES": ""}, gpus=[gpu()]), LoaderConfig()))["environment"]
    assert c.status == "warn" and "sees no GPU" in c.evidence
