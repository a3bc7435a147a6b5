"""Plan memory and per-file cost of ``gpufeed shard --check header`` on many tiny files (structure issue item).

    flock /tmp/gpufeed-bench.lock .venv/bin/python benchmarks/bench_plan_memory.py --sizes 100000 1000000 \\
        --repeats 2 1

For each N: writes N tiny JPEGs (100 classes, 8x8..32x32 px, ~50 distinct encodings written as copies that
differ in a COM segment, so every file has its own bytes) to a RAM disk (/dev/shm) when it has room, reads them
once (warm page cache), then runs, interleaved, ``tar cf`` of the folder and ``gpufeed shard --check header
--workers 2`` into a fresh DEST, timing each whole command with nothing watching it (gpufeed as an installed
package runs: bytecode compiled once, by an unrecorded first run). Then one more shard run per variant measures
memory: it polls the process tree (the main process and its workers)
every 20 ms with psutil and records the peak of the summed RSS and of the main process' RSS, per sample. The
workers are forked, so the summed RSS counts pages they share with the main process more than once: it is an
upper bound; the summed PSS (shared pages split between the processes, polled every 100 ms) is the tree's real
footprint. ``--src DIR`` measures a folder generated earlier instead (kept; N is its file count). Saves JSON
under benchmarks/results/. Never asserts.
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLASSES = 100


def encodings() -> list[bytes]:
    """~50 distinct tiny JPEGs (8x8..32x32 px), each split after its SOI marker for a COM segment."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    out = []
    for i in range(50):
        w, h = 8 + (i * 7) % 25, 8 + (i * 11) % 25
        a = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def generate(root: Path, n: int) -> int:
    """N tiny JPEGs as ROOT/cNNN/img_NNNNNNN.jpg; each gets its own 8-byte COM segment. -> total bytes."""
    encs = encodings()
    total = 0
    for c in range(CLASSES):
        (root / f"c{c:03d}").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        e = encs[i % len(encs)]
        data = e[:2] + b"\xff\xfe\x00\x0a" + i.to_bytes(8, "big") + e[2:]  # SOI, COM(len 10), rest
        with open(root / f"c{i % CLASSES:03d}" / f"img_{i:07d}.jpg", "wb") as f:
            f.write(data)
        total += len(data)
    return total


def warm(root: Path) -> None:
    for d in sorted(root.iterdir()):
        for p in d.iterdir():
            with open(p, "rb") as f:
                f.read()


def run_tar(src: Path, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    p = subprocess.run(["tar", "cf", str(out / "all.tar"), "-C", str(src), "."], capture_output=True)
    wall = time.perf_counter() - t0
    shutil.rmtree(out)
    return {"variant": "tar", "wall_s": wall, "rc": p.returncode}


def shard_cmd(src: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "gpufeed.cli", "shard", str(src), str(out / "shards"), "--check", "header",
            "--workers", "2", "--json"]


def shard_env(code: Path, pycache: Path) -> dict[str, str]:
    """As an installed package runs: its modules' bytecode compiled once and cached (pip compiles it at install;
    this machine sets PYTHONDONTWRITEBYTECODE=1, which would recompile gpufeed's modules on every run)."""
    env = dict(os.environ, PYTHONPATH=str(code), PYTHONPYCACHEPREFIX=str(pycache))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def time_shard(src: Path, out: Path, n: int, code: Path, pycache: Path, variant: str) -> dict:
    """The whole ``gpufeed shard`` command's wall time, nothing watching it (the memory run polls /proc, which
    takes CPU from a 2-core machine's workers)."""
    t0 = time.perf_counter()
    p = subprocess.run(shard_cmd(src, out), capture_output=True, env=shard_env(code, pycache))
    wall = time.perf_counter() - t0
    rec = {"variant": variant, "wall_s": wall, "rc": p.returncode}
    if p.returncode == 0:
        rep = json.loads(p.stdout.decode().strip().splitlines()[-1])
        rec.update({k: rep.get(k) for k in ("num_samples", "num_shards", "validate_s", "write_s", "elapsed_s")})
    else:
        rec["error"] = p.stderr.decode()[-2000:]
    shutil.rmtree(out, ignore_errors=True)
    return rec


def run_shard(src: Path, out: Path, n: int, code: Path, pycache: Path, variant: str) -> dict:
    """The same command, its memory polled (peaks of RSS and PSS); its wall time is not the one reported."""
    import psutil

    t0 = time.perf_counter()
    proc = subprocess.Popen(shard_cmd(src, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=shard_env(code, pycache))
    ps = psutil.Process(proc.pid)
    peak_tree = peak_main = peak_pss = 0
    tick = 0
    while proc.poll() is None:
        try:
            procs = [ps, *ps.children(recursive=True)]
            main = ps.memory_info().rss
            tree = pss = 0
            for p in procs:
                try:
                    tree += p.memory_info().rss
                    if tick % 5 == 0:  # PSS (pages shared with the forked workers counted once) every 100 ms
                        pss += p.memory_full_info().pss
                except psutil.Error:
                    pass
        except psutil.Error:
            break
        peak_tree, peak_main, peak_pss = max(peak_tree, tree), max(peak_main, main), max(peak_pss, pss)
        tick += 1
        time.sleep(0.02)
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    rec = {"variant": variant, "observed_wall_s": wall, "rc": proc.returncode,
           "peak_rss_tree_bytes": peak_tree, "peak_rss_main_bytes": peak_main, "peak_pss_tree_bytes": peak_pss,
           "peak_pss_tree_per_sample": peak_pss / n,
           "peak_rss_tree_per_sample": peak_tree / n, "peak_rss_main_per_sample": peak_main / n}
    if proc.returncode != 0:
        rec["error"] = stderr.decode()[-2000:]
    shutil.rmtree(out, ignore_errors=True)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--repeats", type=int, nargs="+", default=[2, 1], help="per size (the last one repeats)")
    ap.add_argument("--work-dir", default=None, help="default: /dev/shm when it has room, else /tmp")
    ap.add_argument("--baseline-src", default=None,
                    help="a src/ folder of other gpufeed code (e.g. `git archive <commit> src`) also run, once per "
                         "size up to --baseline-max, as variant shard_baseline")
    ap.add_argument("--baseline-max", type=int, default=100_000)
    ap.add_argument("--src", default=None,
                    help="an existing folder this script generated earlier (N = its file count; kept): "
                         "replaces --sizes, skips the generation")
    args = ap.parse_args()
    base = args.work_dir or ("/dev/shm" if shutil.disk_usage("/dev/shm").free > 6 << 30 else tempfile.gettempdir())
    results = []
    given = Path(args.src).resolve() if args.src else None
    sizes = [sum(len(files) for _, _, files in os.walk(given))] if given else args.sizes
    for k, n in enumerate(sizes):
        reps = args.repeats[min(k, len(args.repeats) - 1)]
        work = Path(tempfile.mkdtemp(prefix="gpufeed-planmem-", dir=base))
        src = given or work / "src"
        try:
            t0 = time.perf_counter()
            if given:
                nbytes = sum(p.stat().st_size for p in given.rglob("*") if p.is_file())
            else:
                nbytes = generate(src, n)
            gen_s = time.perf_counter() - t0
            warm(src)
            runs = []
            pycache = work / "pycache"
            variants = [("shard_header_w2", ROOT / "src")]
            if args.baseline_src and n <= args.baseline_max:
                variants.append(("shard_baseline", Path(args.baseline_src).resolve()))
            for variant, code in variants:  # unrecorded: compiles and caches the bytecode
                time_shard(src, work / "out", n, code, pycache, variant)
            for r in range(reps):
                for variant, code in [("tar", None), *variants]:
                    if code is None:
                        rec = run_tar(src, work / "out")
                    else:
                        rec = time_shard(src, work / "out", n, code, pycache, variant)
                    rec.update({"n": n, "repeat": r, "loadavg_1m": os.getloadavg()[0]})
                    runs.append(rec)
                    print(json.dumps(rec), file=sys.stderr)
            mem = []
            for variant, code in variants:
                rec = run_shard(src, work / "out", n, code, pycache, variant)
                rec.update({"n": n, "loadavg_1m": os.getloadavg()[0]})
                mem.append(rec)
                print(json.dumps(rec), file=sys.stderr)
            tar = [x["wall_s"] for x in runs if x["variant"] == "tar"]
            sh = [x["wall_s"] for x in runs if x["variant"] == "shard_header_w2"]
            m = [x for x in mem if x["variant"] == "shard_header_w2"]
            base = [x["wall_s"] for x in runs if x["variant"] == "shard_baseline"]
            summary = {"n": n, "input_bytes": nbytes, "generate_s": gen_s,
                       "tar_wall_s_median": statistics.median(tar),
                       "shard_wall_s_median": statistics.median(sh),
                       "ratio_shard_over_tar": statistics.median(sh) / statistics.median(tar),
                       "ratios_per_repeat": [b / a for a, b in zip(tar, sh)],
                       "baseline_wall_s_median": statistics.median(base) if base else None,
                       "peak_rss_tree_per_sample_max": max(x["peak_rss_tree_per_sample"] for x in m),
                       "peak_rss_main_per_sample_max": max(x["peak_rss_main_per_sample"] for x in m),
                       "peak_pss_tree_per_sample_max": max(x["peak_pss_tree_per_sample"] for x in m),
                       "runs": runs, "memory_runs": mem}
            results.append(summary)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = ROOT / "benchmarks" / "results" / f"bench_plan_memory-{stamp}.json"
    out.write_text(json.dumps({"host": platform.node(), "cpus": os.cpu_count(), "work_dir": base,
                               "python": platform.python_version(), "results": results}, indent=2) + "\n")
    print(f"{'N':>9} {'tar s':>7} {'shard s':>8} {'ratio':>6} {'tree RSS B/sample':>18} {'tree PSS B/sample':>18} "
          f"{'main RSS B/sample':>18}")
    for s in results:
        print(f"{s['n']:>9} {s['tar_wall_s_median']:>7.2f} {s['shard_wall_s_median']:>8.2f} "
              f"{s['ratio_shard_over_tar']:>6.2f} {s['peak_rss_tree_per_sample_max']:>18.0f} "
              f"{s['peak_pss_tree_per_sample_max']:>18.0f} {s['peak_rss_main_per_sample_max']:>18.0f}")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
