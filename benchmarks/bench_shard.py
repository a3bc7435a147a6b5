"""Benchmark ``gpufeed shard`` against what users do today, side by side in one run (the shard issue's proof).

    flock /tmp/gpufeed-bench.lock .venv/bin/python benchmarks/bench_shard.py \\
        --data-dir bench-data/synth-3000 --repeats 3

Variants, each a whole command in a subprocess, as a user runs it:

* ``full``         ``gpufeed shard SRC DEST --json`` (full validation, default workers)
* ``shardwriter``  ``python benchmarks/shardwriter_loop.py SRC DEST``: single-process ``webdataset.ShardWriter``
                   loop with the same validation (PIL open + load + convert); ``import webdataset`` imports
                   torch, which is part of the cost (measured on its own as ``import_wds``)
* ``tar``          ``tar cf DEST/all.tar -C SRC .`` (the floor: read every byte, write one archive)
* ``header``       ``gpufeed shard --check header``
* ``max512``       ``gpufeed shard --max-size 512`` (re-encode), default workers, and ``max512_w1`` with one
* ``w1`` / ``w2``  ``gpufeed shard --workers 1`` / ``--workers 2`` (parallel efficiency)
* ``import_wds``   ``python -c "import webdataset"`` (start-up cost users pay in the ShardWriter loop)
* extras, only with ``--only``: ``header_2sh``, ``w1_2sh``, ``w2_2sh`` add ``--shard-samples N/2`` (two shards,
  so the write phase can use both workers; by default a 3,000-image set is one shard, written serially)

Repeats are interleaved (A B C ... A B C ...), output goes to a RAM disk (/dev/shm) when it has room and
is removed after every run (not timed). The source folder is read once before timing, so every variant
reads it from the page cache. Reports median and min-max wall time, images/s, input MB/s, CPU seconds,
the ratios against the issue's targets, and saves everything as JSON. Never asserts; a failed run is
recorded with its error and shown in the table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
GPUFEED = str(BIN / "gpufeed") if (BIN / "gpufeed").exists() else None


def gpufeed_cmd(*args: str) -> list[str]:
    if GPUFEED:
        return [GPUFEED, *args]
    return [sys.executable, "-m", "gpufeed.cli", *args]


def variants(src: str, out: str, shard_samples: int) -> dict[str, list[str]]:
    d = f"{out}/shards"
    return {
        "full": gpufeed_cmd("shard", src, d, "--json"),
        "shardwriter": [sys.executable, str(ROOT / "benchmarks" / "shardwriter_loop.py"), src, d],
        "tar": ["tar", "cf", f"{out}/all.tar", "-C", src, "."],
        "header": gpufeed_cmd("shard", src, d, "--check", "header", "--json"),
        "max512": gpufeed_cmd("shard", src, d, "--max-size", "512", "--json"),
        "max512_w1": gpufeed_cmd("shard", src, d, "--max-size", "512", "--workers", "1", "--json"),
        "w1": gpufeed_cmd("shard", src, d, "--workers", "1", "--json"),
        "w2": gpufeed_cmd("shard", src, d, "--workers", "2", "--json"),
        "import_wds": [sys.executable, "-c", "import webdataset, sys; print(int('torch' in sys.modules))"],
        # Extras (only with --only): two shards, so the write phase can run on both workers too.
        "header_2sh": gpufeed_cmd("shard", src, d, "--check", "header", "--shard-samples", str(shard_samples),
                                  "--json"),
        "w1_2sh": gpufeed_cmd("shard", src, d, "--workers", "1", "--shard-samples", str(shard_samples), "--json"),
        "w2_2sh": gpufeed_cmd("shard", src, d, "--workers", "2", "--shard-samples", str(shard_samples), "--json"),
        # The engines (issue 22), against w2_2sh: Ray tasks on a local Ray instance of 2 CPUs (its start-up
        # included, as a user pays it), and the static split as two node processes of one worker each.
        "ray_w2_2sh": gpufeed_cmd("shard", src, d, "--engine", "ray", "--workers", "2", "--shard-samples",
                                  str(shard_samples), "--json"),
        "split2_2sh": ["bash", "-c", " & ".join(" ".join(gpufeed_cmd(
            "shard", src, d, "--workers", "1", "--shard-samples", str(shard_samples), "--num-nodes", "2",
            "--node-rank", str(r), "--json")) for r in (0, 1)) + "; wait"],
    }


EXTRAS = ("header_2sh", "w1_2sh", "w2_2sh", "ray_w2_2sh", "split2_2sh")


def scan(src: Path) -> tuple[int, int]:
    """Images and bytes in an ImageFolder; reading every file also warms the page cache."""
    n = total = 0
    for p in sorted(src.rglob("*")):
        if p.is_file() and not p.name.startswith("."):
            with p.open("rb") as f:
                total += len(f.read())
            n += 1
    return n, total


def code_version() -> str:
    """Short hash of the shard code and git HEAD, so runs that straddle an edit are visible."""
    import hashlib

    h = hashlib.sha256()
    for path in [*sorted((ROOT / "src/gpufeed/shard").glob("*.py")), ROOT / "src/gpufeed/cli.py"]:
        try:
            h.update(path.read_bytes())
        except OSError:
            pass
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return f"{head.stdout.strip() or '?'}+{h.hexdigest()[:10]}"


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def run_once(name: str, cmd: list[str], out: Path, num_images: int) -> dict:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    load_1m = os.getloadavg()[0]
    code = code_version()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    rec = {
        "variant": name,
        "wall_s": wall,
        "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "rc": proc.returncode,
        "output_bytes": dir_bytes(out),
        "samples": None,
        "rejected": None,
        "workers": None,
        "error": None,
        "loadavg_1m_before": load_1m,
        "code_version": code,
    }
    if proc.returncode != 0:
        rec["error"] = (proc.stderr or proc.stdout)[-2000:]
    elif name == "tar":
        rec["samples"] = num_images
    elif name == "import_wds":
        rec["samples"] = 0
        rec["imports_torch"] = proc.stdout.strip() == "1"
    else:
        try:
            obj = json.loads(proc.stdout.strip().splitlines()[-1])
            rec["samples"] = obj.get("num_samples", obj.get("samples"))
            rec["rejected"] = obj.get("num_rejected", obj.get("rejected"))
            rec["workers"] = obj.get("workers", 1 if name == "shardwriter" else None)
            for k in ("validate_s", "write_s", "elapsed_s", "import_s", "transforms"):
                if k in obj:
                    rec[k] = obj[k]
        except (ValueError, IndexError) as exc:
            rec["error"] = f"could not parse the command's JSON ({exc}): {proc.stdout[-500:]}"
    if rec["error"] is None and name != "import_wds" and rec["samples"] != num_images:
        rec["error"] = f"wrote {rec['samples']} samples, expected {num_images} (rejected: {rec['rejected']})"
    shutil.rmtree(out, ignore_errors=True)
    return rec


def summarize(runs: list[dict], num_images: int, input_bytes: int) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for name in dict.fromkeys(r["variant"] for r in runs):
        ok = [r for r in runs if r["variant"] == name and r["error"] is None]
        failed = [r for r in runs if r["variant"] == name and r["error"] is not None]
        s: dict = {"runs": len(ok), "failed": len(failed)}
        if ok:
            walls = [r["wall_s"] for r in ok]
            s.update(
                wall_s_median=statistics.median(walls), wall_s_min=min(walls), wall_s_max=max(walls),
                cpu_s_median=statistics.median(r["cpu_s"] for r in ok),
                workers=ok[0].get("workers"),
            )
            if name != "import_wds":
                s.update(
                    images_per_s_median=statistics.median(num_images / w for w in walls),
                    images_per_s_min=num_images / max(walls), images_per_s_max=num_images / min(walls),
                    mb_per_s_median=statistics.median(input_bytes / 1e6 / w for w in walls),
                    output_bytes=ok[0]["output_bytes"],
                )
        out[name] = s
    return out


def paired(runs: list[dict], a: str, b: str) -> list[float]:
    """Per-repeat wall-time ratios wall(b) / wall(a) (runs of one repeat are close in time, so drift cancels)."""
    out = []
    for rep in sorted({r["repeat"] for r in runs}):
        ra = [r for r in runs if r["repeat"] == rep and r["variant"] == a and r["error"] is None]
        rb = [r for r in runs if r["repeat"] == rep and r["variant"] == b and r["error"] is None]
        if ra and rb:
            out.append(rb[0]["wall_s"] / ra[0]["wall_s"])
    return out


def engine_overhead_ms(runs: list[dict], engine: str, local: str, num_images: int) -> list[float]:
    """Per repeat (interleaved, so each pair ran under the same load): (engine wall - local wall) / images, in ms."""
    by = {(r["variant"], r["repeat"]): r for r in runs if r["error"] is None}
    return [(by[(engine, k)]["wall_s"] - by[(local, k)]["wall_s"]) / num_images * 1e3
            for (name, k) in sorted(by) if name == engine and (local, k) in by]


def ratios(summary: dict[str, dict], cpus: int, runs: list[dict]) -> dict[str, dict]:
    def rate(name: str) -> float | None:
        return summary.get(name, {}).get("images_per_s_median")

    def wall(name: str) -> float | None:
        return summary.get(name, {}).get("wall_s_median")

    res: dict[str, dict] = {}
    if rate("full") and rate("shardwriter"):
        v = rate("full") / rate("shardwriter")
        res["full_vs_shardwriter"] = {"value": v, "target": ">= 3.0", "met": v >= 3.0,
                                      "paired": paired(runs, "full", "shardwriter")}
    if wall("header") and wall("tar"):
        v = wall("header") / wall("tar")
        res["header_wall_vs_tar_wall"] = {"value": v, "target": "<= 2.0", "met": v <= 2.0,
                                          "paired": paired(runs, "tar", "header")}
    if rate("max512"):
        workers = summary["max512"].get("workers") or cpus
        v = rate("max512") / workers
        res["max512_images_per_s_per_core"] = {"value": v, "target": ">= 200", "met": v >= 200,
                                               "note": f"default workers ({workers}) run / workers"}
    if rate("max512_w1"):
        v = rate("max512_w1")
        res["max512_w1_images_per_s"] = {"value": v, "target": ">= 200", "met": v >= 200,
                                         "note": "--workers 1: one core's rate, process start-up included"}
    if rate("w1") and rate("w2"):
        v = rate("w2") / rate("w1") / 2
        res["parallel_efficiency_1_to_2"] = {"value": v, "target": ">= 0.90", "met": v >= 0.9,
                                             "paired": [x / 2 for x in paired(runs, "w2", "w1")]}
    if rate("w1_2sh") and rate("w2_2sh"):
        v = rate("w2_2sh") / rate("w1_2sh") / 2
        res["parallel_efficiency_1_to_2_two_shards"] = {"value": v, "target": ">= 0.90", "met": v >= 0.9,
                                                        "paired": [x / 2 for x in paired(runs, "w2_2sh", "w1_2sh")]}
    if wall("header_2sh") and wall("tar"):
        v = wall("header_2sh") / wall("tar")
        res["header_2sh_wall_vs_tar_wall"] = {"value": v, "target": "<= 2.0", "met": v <= 2.0,
                                              "paired": paired(runs, "tar", "header_2sh")}
    if rate("full") and rate("w2"):
        res["full_default_vs_w2"] = {"value": rate("full") / rate("w2"), "target": "~1 (default = usable CPUs)",
                                     "met": None}
    return res


def table(summary: dict[str, dict], runs: list[dict]) -> str:
    lines = [f"{'variant':<12} {'runs':>4} {'wall s (median, min-max)':>26} {'images/s':>9} {'MB/s':>7} "
             f"{'CPU s':>7} {'workers':>7}"]
    for name, s in summary.items():
        if not s["runs"]:
            lines.append(f"{name:<12} {0:>4}  FAILED x{s['failed']}")
            continue
        wall = f"{s['wall_s_median']:.2f} ({s['wall_s_min']:.2f}-{s['wall_s_max']:.2f})"
        ips = f"{s['images_per_s_median']:.0f}" if "images_per_s_median" in s else "-"
        mbs = f"{s['mb_per_s_median']:.1f}" if "mb_per_s_median" in s else "-"
        fail = f"  ({s['failed']} failed)" if s["failed"] else ""
        lines.append(f"{name:<12} {s['runs']:>4} {wall:>26} {ips:>9} {mbs:>7} {s['cpu_s_median']:>7.1f} "
                     f"{str(s.get('workers') or '-'):>7}{fail}")
    errors = [r for r in runs if r["error"]]
    for r in errors:
        lines.append(f"! {r['variant']} repeat {r['repeat']}: {r['error'].strip().splitlines()[-1][:300]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=3000, help="Images to synthesize when --data-dir is not given.")
    p.add_argument("--classes", type=int, default=100, help="Classes to synthesize when --data-dir is not given.")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--data-dir", help="Reuse an existing ImageFolder (e.g. bench-data/synth-3000).")
    p.add_argument("--out", help="JSON result path [default: benchmarks/results/bench_shard-<date>.json].")
    p.add_argument("--work-dir", help="Where outputs are written [default: /dev/shm when it has room].")
    p.add_argument("--only", help="Comma-separated variants to run (default: all but the extras "
                   "header_2sh, w1_2sh, w2_2sh, which write two shards).")
    a = p.parse_args(argv)

    from gpufeed.core.system import environment_snapshot, usable_cpus

    if a.data_dir:
        src = Path(a.data_dir).resolve()
        synth = None
    else:
        src = Path(tempfile.mkdtemp(prefix="gpufeed-bench-src-"))
        print(f"synthesizing {a.images} images into {src} ...", file=sys.stderr, flush=True)
        cmd = gpufeed_cmd("synth", str(src), "--images", str(a.images), "--classes", str(a.classes),
                          "--overwrite", "--json")
        synth = json.loads(subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout)
    num_images, input_bytes = scan(src)
    print(f"data: {src}: {num_images} images, {input_bytes / 1e6:.1f} MB", file=sys.stderr, flush=True)

    shm = Path("/dev/shm")
    if a.work_dir:
        base = Path(a.work_dir)
    elif shm.is_dir() and shutil.disk_usage(shm).free > 3 * input_bytes:
        base = shm
    else:
        base = Path(tempfile.gettempdir())
    work = Path(tempfile.mkdtemp(prefix="gpufeed-bench-", dir=base))
    cmds = variants(str(src), str(work / "out"), max(1, (num_images + 1) // 2))
    if a.only:
        cmds = {k: v for k, v in cmds.items() if k in a.only.split(",")}
    else:
        cmds = {k: v for k, v in cmds.items() if k not in EXTRAS}

    runs: list[dict] = []
    try:
        for rep in range(a.repeats):
            for name, cmd in cmds.items():
                rec = run_once(name, cmd, work / "out", num_images)
                rec["repeat"] = rep
                runs.append(rec)
                status = "ok" if rec["error"] is None else "FAILED"
                print(f"repeat {rep} {name:<12} {rec['wall_s']:7.2f} s  cpu {rec['cpu_s']:6.1f} s  "
                      f"load {rec['loadavg_1m_before']:4.1f}  {status}",
                      file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    cpus = usable_cpus()
    summary = summarize(runs, num_images, input_bytes)
    result = {
        "benchmark": "bench_shard",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {**environment_snapshot(with_torch=False), "processor": platform.processor(),
                    "loadavg_end": os.getloadavg()},
        "data": {"dir": str(src), "images": num_images, "bytes": input_bytes,
                 "mean_bytes": input_bytes / max(num_images, 1), "synth": synth},
        "work_dir": str(base),
        "repeats": a.repeats,
        "commands": {k: " ".join(v) for k, v in cmds.items()},
        "runs": runs,
        "summary": summary,
        "ratios": ratios(summary, cpus, runs),
        "notes": [
            "wall time of the whole command as a user runs it (process start-up, imports, scan, plan, manifest)",
            "the source folder is in the page cache for every variant; output goes to " + str(base),
            "shardwriter: 'import webdataset' imports torch; see import_wds for that cost alone",
        ],
    }
    out = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / f"bench_shard-{dt.date.today()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

    print(table(summary, runs))
    print()
    for k, r in result["ratios"].items():
        met = {True: "met", False: "NOT met", None: ""}[r["met"]]
        pr = ("  per repeat: " + ", ".join(f"{x:.2f}" for x in r["paired"])) if r.get("paired") else ""
        print(f"{k:<32} {r['value']:8.2f}   target {r['target']:<28} {met}{pr}")
    for engine in ("ray_w2_2sh", "split2_2sh"):
        per = engine_overhead_ms(runs, engine, "w2_2sh", num_images)
        if per:
            result.setdefault("engine_overhead_ms_per_image", {})[engine] = per
            print(f"{engine} - w2_2sh per image: median {statistics.median(per):.3f} ms, per repeat "
                  + ", ".join(f"{x:.3f}" for x in per))
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nsaved {out}")
    if synth is not None:
        shutil.rmtree(src, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
