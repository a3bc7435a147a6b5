"""Loader benchmark (the loader issue's proof): gpufeed's tuned loader against what users would otherwise run.

Side by side in one run, same JPEG bytes, same output (uint8 [B, 3, S, S], RandomResizedCrop(S) + flip):

- ``imagefolder-default``  torchvision ImageFolder + DataLoader as the PyTorch ImageNet example runs it
                            (``-j 4`` workers, default prefetch 2, pin_memory);
- ``imagefolder-best``     the same with its own best workers/prefetch (small sweep first);
- ``imagefolder-best-normalized`` the same config with the PyTorch ImageNet example's CPU tail, ``ToTensor()`` +
                            ``Normalize`` (float32 out): what hand-written pipelines do, and what the issue's
                            272 samples/s baseline measured;
- ``wds-recipe``           the plain webdataset README recipe over the shards: ``WebDataset(...).shuffle(1000)
                            .decode("pil").to_tuple("jpg", "cls").map_tuple(transform, identity)`` + DataLoader;
- ``gpufeed-tuned``        ``gpufeed tune`` on the shards (its winner);
- ``gpufeed-exhaustive``   the best of an exhaustive sweep of the tuner's space (scores the tuner);
- ``gpufeed-small``        ``gpufeed tune`` on shards made with ``gpufeed shard --max-size`` (stored-size reduction);
- ``gpufeed-small-fullcfg`` the same small shards read with ``gpufeed-tuned``'s config (when it differs).

The final comparison interleaves the variants round by round (the machine drifts), reports the median
and min–max over all windows, prints a table and writes JSON under benchmarks/results/. Never asserts.

    flock /tmp/gpufeed-bench.lock .venv/bin/python benchmarks/bench_loader.py --data bench-data/synth-3000
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import datetime as dt
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from gpufeed.config import LoaderConfig, TuneConfig  # noqa: E402
from gpufeed.measure.metrics import Stat  # noqa: E402
from gpufeed.core.records import write_json  # noqa: E402
from gpufeed.measure.stream import StreamOptions, measure_stream  # noqa: E402
from gpufeed.tune import (TrialRecord, describe, measure_imagefolder, measure_loader, trial_record,  # noqa: E402
                          tune)
from gpufeed.core.world import World  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def gpufeed_cli(*args: str) -> None:
    cmd = [sys.executable, "-m", "gpufeed.cli", *map(str, args)]
    log("$ gpufeed " + " ".join(map(str, args)))
    subprocess.run(cmd, check=True, cwd=ROOT)


def ensure_data(data: Path, images: int, work: Path, max_size: int, workers: int) -> tuple[Path, Path]:
    if not any(data.glob("*/*")):
        gpufeed_cli("synth", data, "--images", str(images), "--seed", "0")
    full, small = work / "shards-full", work / f"shards-max{max_size}"
    if not (full / "manifest.json").exists():
        gpufeed_cli("shard", data, full, "--multiple-of", str(workers), "--quiet")
    if not (small / "manifest.json").exists():
        gpufeed_cli("shard", data, small, "--multiple-of", str(workers), "--max-size", str(max_size), "--quiet")
    return full, small


# --------------------------------------------------------------------------- the webdataset README recipe


def measure_wds_recipe(shards: Path, cfg: LoaderConfig, world: World, **kw: Any) -> TrialRecord:
    """The plain webdataset recipe over the same shards, measured like every other variant."""
    t0 = time.perf_counter()
    holder: dict[str, Any] = {}

    def open_batches(epoch: int):
        import torch
        import webdataset as wds
        from torchvision import transforms

        if "loader" not in holder:
            from gpufeed.shardset.manifest import read_manifest

            urls = [str(p) for p in read_manifest(shards).shard_paths(shards)]
            tf = transforms.Compose([transforms.RandomResizedCrop(cfg.image_size), transforms.RandomHorizontalFlip(),
                                     transforms.PILToTensor()])
            ds = (wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False).shuffle(1000).decode("pil")
                  .to_tuple("jpg", "cls").map_tuple(tf, lambda x: x))
            extra = {"prefetch_factor": cfg.prefetch_factor} if cfg.num_workers else {}
            holder["loader"] = torch.utils.data.DataLoader(ds, batch_size=cfg.batch_size, num_workers=cfg.num_workers,
                                                           pin_memory=world.is_cuda, **extra)
        return holder["loader"]

    try:
        fields = dataclasses.asdict(measure_stream(open_batches, StreamOptions(
            num_workers=cfg.num_workers, prefetch_factor=cfg.prefetch_factor,
            warmup_batches=kw.get("warmup_batches", 2), window_s=kw.get("window_s", 2.0), repeats=kw.get("repeats", 3),
            deadline=kw.get("deadline"))))
        err = None
    except Exception as exc:
        fields, err = {}, f"{type(exc).__name__}: {exc}"
    finally:
        holder.clear()
    rates = fields.pop("samples_per_s_runs", [])
    fields["wall_s"] = time.perf_counter() - t0
    rec = trial_record(cfg, rates, pipeline="wds-recipe", error=err, **fields)
    if rec.ok and rec.tree_cores_used:
        rec = dataclasses.replace(rec, samples_per_core_s=rec.samples_per_s / rec.tree_cores_used)
    return rec


# --------------------------------------------------------------------------- helpers


def space(usable: int) -> list[dict[str, Any]]:
    """The tuner's search space on this machine (what an exhaustive sweep must cover)."""
    import importlib.util

    decodes = ["pil", "pil-draft"] + (["simplejpeg"] if importlib.util.find_spec("simplejpeg") else [])
    out = []
    for w in range(0, usable + 1):
        for d in decodes:
            for wb in (True, False):
                for pf in ((2, 4) if w else (2,)):
                    out.append(dict(num_workers=w, decode=d, worker_batching=wb, prefetch_factor=pf,
                                    persistent_workers=w > 0))
    return out


def sweep(label: str, fn: Callable[..., TrialRecord], source: Path, configs: list[LoaderConfig], world: World,
          **kw: Any) -> tuple[list[TrialRecord], float]:
    t0 = time.monotonic()
    recs = []
    for i, c in enumerate(configs):
        r = dataclasses.replace(fn(source, c, world, **kw), trial=i, phase=label)
        recs.append(r)
        log(f"{label} {i + 1}/{len(configs)} {describe(r, world.is_cuda):45s} "
            + (f"{r.samples_per_s:7.1f} samples/s" if r.ok else f"ERROR {r.error}"))
    return recs, time.monotonic() - t0


def best_of(recs: list[TrialRecord]) -> TrialRecord | None:
    ok = [r for r in recs if r.ok]
    return max(ok, key=lambda r: r.samples_per_s) if ok else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=ROOT / "bench-data" / "synth-3000", help="gpufeed synth folder")
    ap.add_argument("--images", type=int, default=3000, help="images to synthesise when --data is empty")
    ap.add_argument("--work", type=Path, default=ROOT / "bench-data" / "bench-loader", help="shards go here")
    ap.add_argument("--max-size", type=int, default=320, help="gpufeed shard --max-size for the small set")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--window", type=float, default=2.0, help="seconds per measurement window")
    ap.add_argument("--sweep-window", type=float, default=1.5, help="window of sweep/tuner/exhaustive trials")
    ap.add_argument("--sweep-repeats", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the final comparison")
    ap.add_argument("--repeats", type=int, default=2, help="windows per variant per round")
    ap.add_argument("--tune-budget", type=float, default=180.0)
    ap.add_argument("--no-exhaustive", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()

    from gpufeed.core.system import environment_snapshot, usable_cpus

    t_start = time.monotonic()
    usable = usable_cpus()
    world = World.single()
    full, small = ensure_data(args.data, args.images, args.work, args.max_size, max(1, usable))
    n_images = sum(1 for _ in args.data.glob("*/*"))
    B, S = args.batch_size, args.image_size
    base = LoaderConfig(batch_size=B, image_size=S)
    sw = dict(window_s=args.sweep_window, repeats=args.sweep_repeats, warmup_batches=2)
    result: dict[str, Any] = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                              "command": " ".join(sys.argv), "args": {k: str(v) for k, v in vars(args).items()},
                              "data": {"folder": str(args.data), "num_images": n_images,
                                       "bytes": sum(p.stat().st_size for p in args.data.glob("*/*")),
                                       "shards_full": str(full), "shards_small": str(small)},
                              "environment": environment_snapshot()}

    # 1. ImageFolder's own best workers/prefetch, and the wds recipe's
    if_cfgs = [dataclasses.replace(base, num_workers=w, prefetch_factor=pf, decode="pil", worker_batching=False,
                                   pin_memory=False) for w in sorted({max(1, usable), usable + 1, 2 * usable})
               for pf in (2, 4)]
    if_recs, if_s = sweep("imagefolder-sweep", measure_imagefolder, args.data, if_cfgs, world, **sw)
    wds_cfgs = [dataclasses.replace(base, num_workers=w, prefetch_factor=2, decode="pil", worker_batching=False,
                                    pin_memory=False) for w in sorted({max(1, usable), 2 * usable})]
    wds_recs, wds_s = sweep("wds-sweep", measure_wds_recipe, full, wds_cfgs, world, **sw)

    # 2. the tuner on both shard sets, with the same trial windows as the exhaustive sweep
    def run_tune(shards: Path, name: str) -> Any:
        cfg = TuneConfig(shards=str(shards), budget_s=args.tune_budget, batch_size=B, image_size=S,
                         window_s=args.sweep_window, repeats=args.sweep_repeats, device="cpu",
                         run_dir=str(args.work / f"tune-{name}"), out=str(args.work / f"tuned-{name}.toml"))
        rep = tune(cfg, base, world=world, progress=lambda line: log(f"tune[{name}] {line}"))
        log(f"tune[{name}]: {rep.conclusion} ({rep.num_trials} trials, {rep.elapsed_s:.0f} s)")
        return rep

    tuned_full = run_tune(full, "full")
    tuned_small = run_tune(small, "small")

    # 3. exhaustive sweep of the same space on the full shards
    exh_recs: list[TrialRecord] = []
    exh_s = 0.0
    if not args.no_exhaustive:
        cfgs = [dataclasses.replace(base, **k) for k in space(usable)]
        exh_recs, exh_s = sweep("exhaustive", measure_loader, full, cfgs, world, **sw)
    exh_best = best_of(exh_recs)

    # 4. interleaved final comparison
    if_default = dataclasses.replace(base, num_workers=4, prefetch_factor=2, decode="pil", worker_batching=False,
                                     pin_memory=False)
    variants: list[tuple[str, Callable[..., TrialRecord], Path, LoaderConfig]] = [
        ("imagefolder-default", measure_imagefolder, args.data, if_default),
    ]
    if (b := best_of(if_recs)) is not None:
        variants.append(("imagefolder-best", measure_imagefolder, args.data, b.loader_config(base)))
        variants.append(("imagefolder-best-normalized", functools.partial(measure_imagefolder, normalize=True),
                         args.data, b.loader_config(base)))
    if (b := best_of(wds_recs)) is not None:
        variants.append(("wds-recipe", measure_wds_recipe, full, b.loader_config(base)))
    if tuned_full.best is not None:
        variants.append(("gpufeed-tuned", measure_loader, full, tuned_full.best))
    if exh_best is not None:
        exh_cfg = exh_best.loader_config(base)
        if tuned_full.best is None or _knobs(exh_cfg) != _knobs(tuned_full.best):
            variants.append(("gpufeed-exhaustive", measure_loader, full, exh_cfg))
    if tuned_small.best is not None:
        variants.append(("gpufeed-small", measure_loader, small, tuned_small.best))
    if tuned_full.best is not None and (tuned_small.best is None or _knobs(tuned_small.best) != _knobs(tuned_full.best)):
        # the same bytes-reduced shards read with the full set's winner (guards against a noisy small-set tune)
        variants.append(("gpufeed-small-fullcfg", measure_loader, small, tuned_full.best))

    runs: dict[str, list[TrialRecord]] = {v[0]: [] for v in variants}
    for rnd in range(args.rounds):
        order = variants[rnd % len(variants):] + variants[:rnd % len(variants)]
        for name, fn, src, c in order:
            r = dataclasses.replace(fn(src, c, world, window_s=args.window, repeats=args.repeats, warmup_batches=2),
                                    trial=rnd, phase=name)
            runs[name].append(r)
            log(f"round {rnd + 1}/{args.rounds} {name:20s} {describe(r, world.is_cuda):40s} "
                + (f"{r.samples_per_s:7.1f} samples/s" if r.ok else f"ERROR {r.error}"))

    rows = []
    for name, fn, src, c in variants:
        rates = [x for r in runs[name] if r.ok for x in r.samples_per_s_runs]
        st = Stat.of(rates) if rates else None
        ok = [r for r in runs[name] if r.ok]
        rows.append({
            "variant": name, "config": describe(c, world.is_cuda), "source": str(src), "samples_per_s": st,
            "tree_cores_used": _med([r.tree_cores_used for r in ok]),
            "samples_per_core_s": _med([r.samples_per_core_s for r in ok]),
            "startup_s": _med([r.startup_s for r in ok]),
            "rss_max_mb": _med([r.rss_max_bytes / 1e6 for r in ok if r.rss_max_bytes]),
            "errors": [r.error for r in runs[name] if r.error],
        })
    by = {r["variant"]: r["samples_per_s"].median for r in rows if r["samples_per_s"]}
    ref = by.get("imagefolder-best")
    for r in rows:
        r["x_imagefolder_best"] = (by.get(r["variant"]) / ref) if ref and r["variant"] in by else None

    score = {}
    if exh_best is not None and tuned_full.best is not None:
        t_rate = by.get("gpufeed-tuned")
        e_rate = by.get("gpufeed-exhaustive", t_rate)
        score = {
            "tuner_config": describe(tuned_full.best, world.is_cuda), "exhaustive_config": describe(exh_best, world.is_cuda),
            "same_config": _knobs(exh_best.loader_config(base)) == _knobs(tuned_full.best),
            "tuner_rate_interleaved": t_rate, "exhaustive_best_rate_interleaved": e_rate,
            "tuner_vs_exhaustive": (t_rate / e_rate) if t_rate and e_rate else None,
            "tuner_s": tuned_full.elapsed_s, "tuner_trials": tuned_full.num_trials,
            "exhaustive_s": exh_s, "exhaustive_trials": len(exh_recs),
            "time_ratio": tuned_full.elapsed_s / exh_s if exh_s else None,
            "exhaustive_best_in_sweep": exh_best.samples_per_s,
        }
    targets = {
        "tuned_vs_imagefolder_best (target >= 2)": _ratio(by, "gpufeed-tuned", "imagefolder-best"),
        "small_vs_imagefolder_best (target >= 4)": _ratio(by, "gpufeed-small", "imagefolder-best"),
        "tuned_vs_imagefolder_best_normalized": _ratio(by, "gpufeed-tuned", "imagefolder-best-normalized"),
        "small_vs_imagefolder_best_normalized": _ratio(by, "gpufeed-small", "imagefolder-best-normalized"),
        "small_fullcfg_vs_imagefolder_best (target >= 4)": _ratio(by, "gpufeed-small-fullcfg", "imagefolder-best"),
        "tuner_within_5pct_of_exhaustive": None if not score.get("tuner_vs_exhaustive") else
        score["tuner_vs_exhaustive"] >= 0.95,
        "tuner_time_le_third_of_exhaustive": None if not score.get("time_ratio") else score["time_ratio"] <= 1 / 3,
    }
    result.update(rows=rows, score=score, targets=targets,
                  tune_full=dataclasses.replace(tuned_full, trials=[]), tune_small=dataclasses.replace(tuned_small,
                                                                                                      trials=[]),
                  trials={"imagefolder_sweep": if_recs, "wds_sweep": wds_recs, "tune_full": tuned_full.trials,
                          "tune_small": tuned_small.trials, "exhaustive": exh_recs,
                          "final": [r for rs in runs.values() for r in rs]},
                  timings_s={"imagefolder_sweep": if_s, "wds_sweep": wds_s, "exhaustive": exh_s,
                             "total": time.monotonic() - t_start})
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"bench_loader-{dt.datetime.now(dt.timezone.utc).strftime('%Y%m%d-%H%M%S')}.json"
    write_json(path, result)

    print(f"\nloader benchmark: {n_images} images ({result['data']['bytes'] / 1e6:.0f} MB), batch {B}, {S}px, "
          f"{usable} CPUs, {args.rounds} interleaved rounds x {args.repeats} windows of {args.window:g} s")
    print(f"{'variant':22} {'config':40} {'samples/s median (min-max)':>30} {'x IF-best':>9} {'cores':>5} "
          f"{'/core':>6} {'start s':>7}")
    for r in rows:
        st = r["samples_per_s"]
        print(f"{r['variant']:22} {r['config'][:40]:40} "
              f"{(st.fmt() if st else 'error'):>30} {_f(r['x_imagefolder_best'], 2):>9} "
              f"{_f(r['tree_cores_used'], 2):>5} {_f(r['samples_per_core_s'], 0):>6} {_f(r['startup_s'], 2):>7}")
    if score:
        print(f"tuner: {score['tuner_config']} in {score['tuner_s']:.0f} s / {score['tuner_trials']} trials; exhaustive: "
              f"{score['exhaustive_config']} in {score['exhaustive_s']:.0f} s / {score['exhaustive_trials']} trials; "
              f"tuner/exhaustive rate {_f(score['tuner_vs_exhaustive'], 3)}, time {_f(score['time_ratio'], 2)}")
    for k, v in targets.items():
        print(f"  {k}: {_f(v, 2) if isinstance(v, float) else v}")
    print(f"wrote {path} (total {time.monotonic() - t_start:.0f} s)")


def _knobs(c: LoaderConfig) -> tuple:
    return (c.num_workers, c.decode, c.worker_batching, c.prefetch_factor if c.num_workers else None)


def _med(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return Stat.of(xs).median if xs else None


def _ratio(by: dict[str, float], a: str, b: str) -> float | None:
    return by[a] / by[b] if a in by and b in by and by[b] else None


def _f(v: Any, d: int) -> str:
    return "-" if v is None else f"{v:.{d}f}"


if __name__ == "__main__":
    main()
