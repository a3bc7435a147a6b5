from __future__ import annotations

from gpufeed.measure.verdict import Verdict, VerdictInputs, classify


def test_fed_when_stall_low_and_near_the_lower_ceiling() -> None:
    v = classify(VerdictInputs(stall_pct=2.0, end_to_end_rate=2900, gpu_ceiling=3000, loader_ceiling=5000,
                               is_cuda=True))
    assert v.status == "fed" and v.ok and v.bound is None
    assert v.reason == ("data stall 2.0% < 5% and 2900.0 samples/s = 97% of the GPU ceiling (3000.0); "
                        "the GPU is the bound, as it should be")
    assert abs(v.numbers["fraction_of_ceiling"] - 2900 / 3000) < 1e-9


def test_on_the_cpu_the_synthetic_rate_is_the_cpus_compute_ceiling_not_a_gpus() -> None:
    v = classify(VerdictInputs(stall_pct=2.0, end_to_end_rate=2.9, gpu_ceiling=3.0, loader_ceiling=1500.0))
    assert v.reason == ("data stall 2.0% < 5% and 2.9 samples/s = 97% of the compute ceiling (CPU) (3.0); "
                        "the CPU's compute is the bound, as it should be")
    slow = classify(VerdictInputs(stall_pct=30.0, end_to_end_rate=1.0, gpu_ceiling=3.0, loader_ceiling=1500.0))
    assert slow.reason.startswith("data stall 30.0% (>= 5%) at 1.0 samples/s, 33% of the compute ceiling (CPU) (3.0)")
    unverified = classify(VerdictInputs(stall_pct=1.0, end_to_end_rate=3.0))
    assert "whether this is the CPU's own compute speed is unknown" in unverified.reason
    assert "GPU" not in v.reason + slow.reason + unverified.reason
    gpu = classify(VerdictInputs(stall_pct=30.0, end_to_end_rate=1.0, gpu_ceiling=3.0, loader_ceiling=1500.0,
                                 is_cuda=True))
    assert gpu.reason.startswith("data stall 30.0% (>= 5%) at 1.0 samples/s, 33% of the GPU ceiling (3.0)")


def test_low_stall_without_ceilings_is_unverified_not_fed() -> None:
    v = classify(VerdictInputs(stall_pct=1.0, end_to_end_rate=100))
    assert v.status == "unverified" and v.ok and "--measure" in v.reason
    assert classify(VerdictInputs(stall_pct=20.0, end_to_end_rate=100)).status == "starved"


GAP = dict(stall_pct=3.0, end_to_end_rate=500, gpu_ceiling=1000, loader_ceiling=4000, loader_cores_used=4,
           usable_cores=8, num_workers=4, read_bytes_per_s=1e6)
"""Low stall, but half the compute ceiling: the gap needs a cause."""


def test_low_stall_far_below_the_ceiling_without_a_measured_cause_is_inconclusive_unexplained() -> None:
    v = classify(VerdictInputs(**GAP))
    assert v.status == "inconclusive" and v.cause == "unexplained" and not v.ok
    assert "compute per step not measured" in v.reason and "no measured cause explains the gap" in v.reason
    # the same compute per step in both modes: still no cause, and the numbers say so
    same = classify(VerdictInputs(**GAP, real_compute_step_s=0.101, synthetic_compute_step_s=0.1))
    assert same.cause == "unexplained" and "0.101 s real, 0.100 s synthetic" in same.reason
    # no fix that its own numbers contradict: nothing about giving the loader cores
    assert not any("cores of its own" in fx for fx in v.fixes + same.fixes)


def test_the_loaders_processes_on_the_trainers_cores_are_named_with_their_cores() -> None:
    v = classify(VerdictInputs(**GAP, real_compute_step_s=0.2, synthetic_compute_step_s=0.1, real_cores_used=7.8,
                               synthetic_cores_used=6.0))
    assert v.status == "starved" and v.bound == "decode/CPU" and not v.ok
    assert "compute took 0.200 s per step in the real mode against 0.100 s on the synthetic batch (+100%)" in v.reason
    assert "took 1.80 cores on top of the 6.00 the trainer used alone, 7.80 of 8 usable" in v.reason
    assert v.fixes == ["give the loader cores of its own: torch threads = 6 per node (--threads) leaves 1.8 cores "
                       "to the loader, or make decoding cheaper"]
    # a loader that used (almost) no cores cannot be what slowed compute: no such fix
    idle = classify(VerdictInputs(**GAP, real_compute_step_s=0.2, synthetic_compute_step_s=0.1, real_cores_used=6.1,
                                  synthetic_cores_used=6.0))
    assert idle.cause == "unexplained" and not any("cores of its own" in fx for fx in idle.fixes)


def test_a_trainer_that_fills_the_machine_alone_is_named_when_the_loader_takes_from_it() -> None:
    """Measured on this repo's 2-core machine (no other processes): the trainer alone kept 1.99 of 2 cores busy,
    trainer + one worker 1.95 (the machine was full: the worker's cores came out of the trainer's), compute +27%."""
    gap = {**GAP, "usable_cores": 2.0, "end_to_end_rate": 100.2, "gpu_ceiling": 130.8, "loader_ceiling": 699.4,
           "loader_cores_used": 1.09, "real_compute_step_s": 0.154, "synthetic_compute_step_s": 0.121,
           "real_cores_used": 1.95, "synthetic_cores_used": 1.99}
    v = classify(VerdictInputs(**gap))
    assert v.status == "starved" and v.bound == "decode/CPU", v.reason
    assert "the trainer alone kept 1.99 of 2 usable cores busy" in v.reason
    assert "~0.16 cores at 100.2 samples/s" in v.reason and "641.7 samples/s per core" in v.reason
    assert not any("torch threads = " in fx for fx in v.fixes)  # no thread count the run did not measure
    assert "lowers the compute ceiling" in v.fixes[0]
    # a trainer that leaves cores free: its slowdown is not explained by the loader's 0.16 cores
    free = classify(VerdictInputs(**{**gap, "usable_cores": 8.0, "synthetic_cores_used": 2.0, "real_cores_used": 2.1}))
    assert free.cause == "unexplained"
    # a loader too cheap to matter even on a full machine
    cheap = classify(VerdictInputs(**{**gap, "loader_cores_used": 0.05}))
    assert cheap.cause == "unexplained"


def test_a_gpu_that_throttled_only_in_the_real_mode_is_named() -> None:
    v = classify(VerdictInputs(**{**GAP, "is_cuda": True}, real_compute_step_s=0.2, synthetic_compute_step_s=0.1,
                               gpu_slowdowns=("hw_thermal_slowdown",), synthetic_gpu_slowdowns=()))
    assert v.status == "slowed" and v.cause == "GPU throttle" and not v.ok
    assert "hw_thermal_slowdown" in v.reason and "nvidia-smi" in v.fixes[0]
    assert v.render().startswith("verdict: SLOWED (GPU throttle): ")
    # throttled in both modes: the ceiling was measured throttled too, so it is not the cause of the gap
    both = classify(VerdictInputs(**{**GAP, "is_cuda": True}, real_compute_step_s=0.2, synthetic_compute_step_s=0.1,
                                  gpu_slowdowns=("sw_power_cap",), synthetic_gpu_slowdowns=("sw_power_cap",)))
    assert both.cause == "unexplained"


def test_real_batches_unlike_the_synthetic_one_are_named() -> None:
    v = classify(VerdictInputs(**GAP, real_compute_step_s=0.15, synthetic_compute_step_s=0.1,
                               real_batch="uint8 [32, 3, 224, 224] strided cuda",
                               synthetic_batch="uint8 [32, 3, 224, 224] contiguous cuda"))
    assert v.status == "slowed" and v.cause == "batches differ"
    assert "strided" in v.reason and "contiguous" in v.fixes[0]


def test_a_ceiling_below_the_end_to_end_rate_is_unreliable_not_fed() -> None:
    v = classify(VerdictInputs(stall_pct=1.0, end_to_end_rate=200, gpu_ceiling=100, loader_ceiling=5000))
    assert v.status == "inconclusive" and v.cause == "unreliable ceiling" and not v.ok
    assert "200% of the compute ceiling (CPU) (100.0)" in v.reason
    # within the margin it is still fed (101% of the ceiling is measurement noise, not a wrong ceiling)
    assert classify(VerdictInputs(stall_pct=1.0, end_to_end_rate=101, gpu_ceiling=100, loader_ceiling=5000)).status == "fed"


def test_windows_that_did_not_settle_make_it_inconclusive_too_noisy() -> None:
    from gpufeed.measure.verdict import ModeWindows

    v = classify(VerdictInputs(stall_pct=6.8, end_to_end_rate=50, gpu_ceiling=49.6, loader_ceiling=900,
                               windows=(ModeWindows("synthetic", True, 3, 0.04, 0.0),
                                        ModeWindows("real", False, 5, 0.31, 9.5))))
    assert v.status == "inconclusive" and v.cause == "too noisy"
    assert "real: 5 window(s), samples/s interval 31% wide, stall interval 9.5 points wide" in v.reason
    assert "synthetic" not in v.reason.split("(")[1].split(";")[0]
    assert v.numbers["unsettled"]["real"]["rate_spread"] == 0.31
    settled = classify(VerdictInputs(stall_pct=1.0, end_to_end_rate=48, gpu_ceiling=49.6, loader_ceiling=900,
                                     windows=(ModeWindows("real", True, 3, 0.05, 0.4),)))
    assert settled.status == "fed"


def test_decode_bound_names_cores_needed_at_per_core_rate() -> None:
    # loader: 400 samples/s on 4 cores = 100/core; GPU wants 2000 -> 20 cores, 16 more; node has 32
    v = classify(VerdictInputs(stall_pct=60.0, end_to_end_rate=400, gpu_ceiling=2000, loader_ceiling=400,
                               loader_cores_used=4.0, usable_cores=32, num_workers=4, read_bytes_per_s=5e7,
                               is_cuda=True, decode="pil", mean_sample_bytes=110_000))
    assert v.status == "starved" and v.bound == "decode/CPU"
    assert v.numbers["per_core_rate"] == 100.0
    assert v.numbers["cores_needed_per_node"] == 20.0
    text = "\n".join(v.fixes)
    assert "needs ~16 more cores at the measured 100.0 samples/s per core" in text
    assert "raise num_workers to ~20" in text
    assert "use GPU decode" in text
    assert "<= 512 px" in text and "110 KB" in text


def test_decode_bound_beyond_the_node_says_workers_cannot_close_it() -> None:
    v = classify(VerdictInputs(stall_pct=80.0, end_to_end_rate=100, gpu_ceiling=3000, loader_ceiling=100,
                               loader_cores_used=2.0, usable_cores=8, num_workers=2, read_bytes_per_s=1e7))
    assert v.bound == "decode/CPU"
    assert any("only 8 cores" in f for f in v.fixes)
    assert not any("GPU decode" in f for f in v.fixes)  # no CUDA


def test_num_workers_zero_says_loading_is_serial() -> None:
    v = classify(VerdictInputs(stall_pct=30.0, end_to_end_rate=70, gpu_ceiling=100, loader_ceiling=1000,
                               loader_cores_used=1.0, usable_cores=2, num_workers=0, read_bytes_per_s=1e6))
    assert v.bound == "decode/CPU"
    assert any("num_workers = 0" in f for f in v.fixes)


STORAGE_RUN = dict(stall_pct=40.0, end_to_end_rate=600, gpu_ceiling=1000, loader_ceiling=600, loader_cores_used=10,
                   usable_cores=32, num_workers=2, read_bytes_per_s=95e6, storage_bytes_per_s=100e6,
                   mean_sample_bytes=110_000, is_cuda=True, storage_source="probe", shards="/nfs/imagenet/train")
"""A run reading at the storage's limit: 95 of 100 MB/s; 1000 samples/s x 110 KB = 110 MB/s needed."""


def test_storage_bound_when_reading_at_the_storage_rate() -> None:
    v = classify(VerdictInputs(**STORAGE_RUN))
    assert v.status == "starved" and v.bound == "storage"
    assert v.reason == ("data stall 40.0% (>= 5%) at 600.0 samples/s, 100% of the loader ceiling (600.0); the loader "
                        "reads at the storage's limit: 95.0 MB/s, 95% of the 100.0 MB/s the storage delivers, probe")
    assert v.fixes[0] == ("the GPUs need ~110.0 MB/s per node at 1000 samples/s x 110 KB/sample; the storage "
                          "delivers 100.0 MB/s")
    assert v.numbers["needed_bytes_per_s"] == 1000 * 110_000


def test_storage_fix_stages_to_dev_shm_when_the_set_fits() -> None:
    v = classify(VerdictInputs(**STORAGE_RUN, set_bytes=140_000_000_000, shm_free_bytes=500_000_000_000))
    assert v.fixes[1] == ("stage the set to /dev/shm with gpufeed stage /nfs/imagenet/train /dev/shm/train "
                          "(fits: 140.0 GB of 500.0 GB free in /dev/shm)")
    assert v.numbers["fits_shm"] is True


def test_storage_fix_suggests_local_nvme_when_the_set_does_not_fit_in_dev_shm() -> None:
    v = classify(VerdictInputs(**{**STORAGE_RUN, "shards": "/nfs/imagenet/train/manifest.json"},
                               set_bytes=140_000_000_000, shm_free_bytes=64_000_000_000))
    assert v.fixes[1] == ("stage the set to local NVMe with gpufeed stage /nfs/imagenet/train/manifest.json "
                          "NVME_FOLDER/train: it does not fit in /dev/shm (140.0 GB, 64.0 GB free)")
    assert v.numbers["fits_shm"] is False


def test_storage_fix_names_the_parallel_streams_the_probe_showed() -> None:
    # 1 reader 40 MB/s, 4 readers 100, 8 readers 130: 110 MB/s needs 8 streams; the loader reads with 2
    ladder = ((1, 40e6), (2, 70e6), (4, 100e6), (8, 130e6))
    v = classify(VerdictInputs(**STORAGE_RUN, storage_ladder=ladder))
    assert v.fixes[-2] == ("needs 8 parallel streams: the storage read 40.0 MB/s with 1 reader(s) and 130.0 MB/s "
                           "with 8; the loader reads 2 at once (1 rank(s) x 2 worker(s)): num_workers >= 8 per rank")
    assert (v.numbers["streams_needed"], v.numbers["streams_now"]) == (8, 2)
    # a ladder that is flat (more readers read no more) or already matched by the loader says nothing of streams
    flat = classify(VerdictInputs(**STORAGE_RUN, storage_ladder=((1, 100e6), (2, 101e6), (4, 99e6))))
    assert not any("parallel streams" in f for f in flat.fixes)
    enough = classify(VerdictInputs(**{**STORAGE_RUN, "num_workers": 8}, storage_ladder=ladder))
    assert not any("parallel streams" in f for f in enough.fixes)


def test_storage_fix_for_a_remote_set_names_remote_streams() -> None:
    ladder = ((1, 40e6), (2, 70e6), (4, 100e6), (8, 130e6))
    v = classify(VerdictInputs(**STORAGE_RUN, storage_ladder=ladder, remote_streams=1))
    assert v.fixes[-2] == ("needs 8 parallel streams: the storage read 40.0 MB/s with 1 reader(s) and 130.0 MB/s "
                           "with 8; the loader reads 2 at once (1 rank(s) x 2 worker(s) x 1 range request(s)): set "
                           "[loader] remote_streams = 4 (requests in flight per worker; or more workers)")
    enough = classify(VerdictInputs(**STORAGE_RUN, storage_ladder=ladder, remote_streams=4))  # 2 x 4 = 8 at once
    assert not any("parallel streams" in f for f in enough.fixes)


def test_storage_bound_at_the_loaders_own_concurrency_on_a_per_connection_limited_store() -> None:
    # an object store that gives each connection 10 MB/s: the probe's ladder reaches 80 MB/s with 8 readers, but
    # a loader with 1 rank x 1 worker x 1 range request reads 9.5 MB/s: at the storage's limit for ONE reader
    ladder = ((1, 10e6), (2, 20e6), (4, 40e6), (8, 80e6))
    run = {**STORAGE_RUN, "num_workers": 1, "read_bytes_per_s": 9.5e6, "storage_bytes_per_s": 80e6,
           "shards": "https://data.example/train"}
    v = classify(VerdictInputs(**run, storage_ladder=ladder, remote_streams=1))
    assert v.bound == "storage"
    assert v.reason.endswith("the loader reads at the storage's limit: 9.5 MB/s, 95% of the 10.0 MB/s the storage "
                             "delivers to 1 reader(s) at once, as the loader reads (up to 80.0 MB/s with more, probe)")
    assert v.numbers["storage_bytes_per_s_at_loader"] == 10e6
    assert any(f.endswith("set [loader] remote_streams = 8 (requests in flight per worker; or more workers)")
               for f in v.fixes)
    # the same loader with 8 requests in flight reads at the ladder's 8-reader rate: judged against 80 MB/s
    wide = classify(VerdictInputs(**{**run, "read_bytes_per_s": 76e6}, storage_ladder=ladder, remote_streams=8))
    assert wide.bound == "storage" and "95% of the 80.0 MB/s the storage delivers, probe" in wide.reason
    # without a ladder (an explicit --storage-rate) the one rate is the limit: 9.5 of 80 MB/s is not storage-bound
    flat = classify(VerdictInputs(**run, remote_streams=1))
    assert flat.bound != "storage"


def test_storage_bound_when_workers_idle_while_reading() -> None:
    v = classify(VerdictInputs(stall_pct=50.0, end_to_end_rate=300, gpu_ceiling=1000, loader_ceiling=300,
                               loader_cores_used=1.0, usable_cores=16, num_workers=8, read_bytes_per_s=30e6))
    assert v.bound == "storage"
    assert "idle" in v.reason


def test_copy_bound() -> None:
    v = classify(VerdictInputs(stall_pct=20.0, end_to_end_rate=800, gpu_ceiling=1000, loader_ceiling=5000,
                               copy_wait_pct=15.0))
    assert v.bound == "copy"
    assert any("pin_memory" in f for f in v.fixes)


def test_rank_imbalance() -> None:
    v = classify(VerdictInputs(stall_pct=12.0, end_to_end_rate=800, gpu_ceiling=1000, loader_ceiling=1500,
                               per_rank_stall_pct=(1.0, 2.0, 1.5, 40.0), ranks_per_node=4, num_workers=6))
    assert v.bound == "rank imbalance"
    assert "rank 3 stalls 40.0%" in v.reason
    assert any("--multiple-of 24" in f for f in v.fixes)


def test_even_high_stall_across_ranks_is_not_imbalance() -> None:
    v = classify(VerdictInputs(stall_pct=40.0, end_to_end_rate=600, gpu_ceiling=1000, loader_ceiling=600,
                               per_rank_stall_pct=(38.0, 42.0), loader_cores_used=4, usable_cores=8, num_workers=2,
                               read_bytes_per_s=1e6))
    assert v.bound == "decode/CPU"


def test_render_puts_status_and_fixes() -> None:
    v = Verdict("starved", "copy", "because", ["a", "b"])
    assert v.render().splitlines() == ["verdict: STARVED (copy-bound): because", "  fix: a", "  fix: b"]
    assert not v.ok


def test_stalled_although_the_loader_is_fast_enough_on_average() -> None:
    v = classify(VerdictInputs(stall_pct=12.0, end_to_end_rate=880, gpu_ceiling=1000, loader_ceiling=3000,
                               loader_cores_used=6, usable_cores=16, num_workers=3, read_bytes_per_s=1e6))
    assert v.bound == "decode/CPU" and "arrive late" in v.reason
    assert any("prefetch_factor" in f for f in v.fixes)


def test_gpu_decode_time_is_not_blamed_on_the_copy() -> None:
    v = classify(VerdictInputs(stall_pct=20.0, end_to_end_rate=2000, gpu_ceiling=3000, loader_ceiling=2500,
                               copy_wait_pct=18.0, decode="gpu"))
    assert v.status == "starved" and v.bound == "GPU decode" and "pin_memory" not in " ".join(v.fixes)
    v = classify(VerdictInputs(stall_pct=20.0, end_to_end_rate=2000, gpu_ceiling=3000, loader_ceiling=2500,
                               copy_wait_pct=18.0, decode="simplejpeg"))
    assert v.bound == "copy"


# --------------------------------------------------------------------------- gpufeed.measure.bounds (shared with tune)


def test_bounds_predicates_at_their_thresholds() -> None:
    from gpufeed.measure import bounds

    assert bounds.copy_limited(5.0, 10.0) and not bounds.copy_limited(4.9, 10.0)  # half of the stall
    assert not bounds.copy_limited(0.9, 1.0) and not bounds.copy_limited(None, 10.0)  # under 1 %: noise
    assert bounds.storage_limited(80e6, 100e6) and not bounds.storage_limited(79e6, 100e6)
    assert not bounds.storage_limited(80e6, None) and not bounds.storage_limited(None, 100e6)
    assert bounds.idle_while_reading(1.9, 4, 1e6) and not bounds.idle_while_reading(2.0, 4, 1e6)
    assert not bounds.idle_while_reading(1.0, 4, 0.0)  # not reading: not waiting on storage
    assert bounds.cpu_saturated(3.0, 4) and not bounds.cpu_saturated(2.9, 4)
    assert bounds.cpu_saturated(0.5, 4, machine_busy_pct=90.0) and not bounds.cpu_saturated(0.5, 4, 89.9)
    assert bounds.per_core_rate(400.0, 4.0) == 100.0 and bounds.per_core_rate(400.0, 0.0) is None
    assert bounds.cores_needed(2000.0, 100.0) == 20.0
    assert bounds.label("decode/CPU") == "decode/CPU-bound" and bounds.label("unclear") == "bound unclear"


def test_verdict_uses_the_shared_storage_and_idle_thresholds() -> None:
    common = dict(stall_pct=40.0, end_to_end_rate=600, gpu_ceiling=1000, loader_ceiling=600, usable_cores=32,
                  num_workers=8)
    at = classify(VerdictInputs(**common, loader_cores_used=10, read_bytes_per_s=80e6, storage_bytes_per_s=100e6))
    below = classify(VerdictInputs(**common, loader_cores_used=10, read_bytes_per_s=79e6, storage_bytes_per_s=100e6))
    assert (at.bound, below.bound) == ("storage", "decode/CPU")
    idle = classify(VerdictInputs(**common, loader_cores_used=3.9, read_bytes_per_s=1e6))  # < 0.5 x 8 slots
    busy = classify(VerdictInputs(**common, loader_cores_used=4.0, read_bytes_per_s=1e6))
    assert (idle.bound, busy.bound) == ("storage", "decode/CPU")


# --------------------------------------------------------------------------- the rules


def test_the_first_rule_that_fires_wins_and_carries_its_numbers() -> None:
    from gpufeed.measure import verdict

    gpu_run = VerdictInputs(stall_pct=20.0, end_to_end_rate=2000, gpu_ceiling=3000, loader_ceiling=2500,
                            copy_wait_pct=18.0, decode="gpu")
    facts = verdict.derive(gpu_run)
    both = (verdict.gpu_decode(facts), verdict.copy(facts))  # both rules fire on this run
    assert [v.bound for v in both] == ["GPU decode", "copy"]
    assert all(v.numbers["copy_wait_pct"] == 18.0 and v.numbers["target_rate"] == 3000 for v in both)
    assert verdict.RULES.index(verdict.gpu_decode) < verdict.RULES.index(verdict.copy)
    assert classify(gpu_run).bound == "GPU decode"
    swapped = [verdict.copy if r is verdict.gpu_decode else verdict.gpu_decode if r is verdict.copy else r
               for r in verdict.RULES]
    assert classify(gpu_run, swapped).bound == "copy"
    # the last rule always fires; a rule that does not fire returns None
    assert verdict.decode_cpu(facts).bound == "decode/CPU" and verdict.rank_imbalance(facts) is None
    assert verdict.fed(facts) is None and verdict.unverified(facts) is None


# --------------------------------------------------------------------------- other processes on the machine

def _neighbours(**per_mode: float):
    from gpufeed.measure.verdict import ModeNeighbours

    return tuple(ModeNeighbours(mode.replace("_", "-"), cores, 2, "stress", 4242, cores, None)
                 for mode, cores in per_mode.items())


STARVED_RUN = dict(stall_pct=40.0, end_to_end_rate=600, gpu_ceiling=1000, loader_ceiling=600, loader_cores_used=2,
                   usable_cores=2, num_workers=2, read_bytes_per_s=95e6, storage_bytes_per_s=100e6)
"""Numbers that alone would name a storage bound."""


def test_other_processes_in_one_mode_make_the_verdict_inconclusive_naming_the_mode_and_process() -> None:
    v = classify(VerdictInputs(**STARVED_RUN, neighbours=_neighbours(synthetic=0.05, loader_only=1.2, real=0.1)))
    assert v.status == "inconclusive" and v.cause == "other processes" and v.bound is None and not v.ok
    assert v.reason.startswith("other processes held 1.20 of 2 cores in the loader-only mode")
    assert "synthetic 0.05, loader-only 1.20, real 0.10" in v.reason and "stress (pid 4242, 1.20 cores)" in v.reason
    assert v.fixes == ["run on an idle machine, or pin the run with taskset/cgroups"]
    assert "storage" not in v.render()  # never a bound built on disturbed numbers


def test_other_processes_in_every_mode_and_on_a_small_machine() -> None:
    v = classify(VerdictInputs(**STARVED_RUN, neighbours=_neighbours(synthetic=0.6, loader_only=0.7, real=0.9)))
    assert v.cause == "other processes" and "0.90 of 2 cores in every mode" in v.reason
    # 0.3 of 2 cores is under 0.5 core but more than 10% of the machine
    small = classify(VerdictInputs(**STARVED_RUN, neighbours=_neighbours(synthetic=0.0, loader_only=0.0, real=0.3)))
    assert small.cause == "other processes" and "the real mode" in small.reason


def test_without_other_processes_the_numbers_decide() -> None:
    v = classify(VerdictInputs(**STARVED_RUN, neighbours=_neighbours(synthetic=0.02, loader_only=0.1, real=0.15)))
    assert v.status == "starved" and v.bound == "storage"


def test_another_process_on_the_gpu_is_named_with_its_memory() -> None:
    from gpufeed.measure.verdict import ModeNeighbours

    n = (ModeNeighbours("real", 0.0, 64, "python", 777, 0.0, 30_000_000_000),)
    v = classify(VerdictInputs(**STARVED_RUN, neighbours=n))
    assert v.cause == "other processes" and "python (pid 777, 30.0 GB on the GPU)" in v.reason


def test_a_training_run_without_ceilings_stays_unverified_beside_other_processes() -> None:
    n = _neighbours(real=1.5)
    assert classify(VerdictInputs(stall_pct=1.0, end_to_end_rate=100, neighbours=n)).status == "unverified"
    # a high stall beside them is not called starved: the bound would rest on disturbed numbers
    assert classify(VerdictInputs(stall_pct=30.0, end_to_end_rate=100, neighbours=n)).cause == "other processes"
