"""Remote shard sets benchmark (issue 10's proof numbers), over real loopback sockets (tests/common/netserver.py):

(a) **loader over HTTP vs local**: the same shard folder read by ``gpufeed.loader`` from disk and from a loopback
    HTTP server (no throttle), same seed and config, one epoch per run, the two variants interleaved round by round
    (the machine drifts). Reports samples/s (median and min-max over rounds), the HTTP/local ratio, and whether
    the two delivered the same samples in the same order (every batch's labels and a sha256 of its image bytes).
(b) **throttled source, then staged**: a one-shard set served at ``--bandwidth`` bytes/s per connection, read by
    one stream (``remote_streams = 1``, no workers);
    ``gpufeed train --measure`` (tiny CPU model) on the URL, ``gpufeed stage URL /dev/shm/...``, and the same run
    on the staged copy. Reports the probed storage MB/s, the loader's read MB/s (loader-only samples/s x the
    manifest's mean sample bytes), the stall and the verdict of each, and the stage MB/s. As in the proof test
    (tests/test_remote_storage.py) the remote reader's range size is scaled down to 16 KiB with the tiny set and
    the shuffle buffer is 4, so the timed steps read from the socket.

Prints a markdown block and writes JSON under benchmarks/results/. Never asserts.

    flock /tmp/gpufeed-bench.lock .venv/bin/python benchmarks/bench_remote.py --rounds 3
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from gpufeed.config import LoaderConfig  # noqa: E402
from gpufeed.core.records import write_json  # noqa: E402
from gpufeed.core.world import World  # noqa: E402
from tests.common.netserver import LoopbackServer  # noqa: E402
from tests.common.shards import write_tiny_shards  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def epoch(spec: str, cfg: LoaderConfig) -> tuple[float, int, list[tuple[list[int], str]]]:
    """One epoch of the loader over ``spec``: (seconds, samples, [(labels, sha256 of the images) per batch])."""
    from gpufeed.loader import build_loader

    loader = build_loader(spec, cfg, World.single())
    t0 = time.perf_counter()
    seen, n = [], 0
    for images, labels in loader:
        n += len(labels)
        seen.append((labels.tolist(), hashlib.sha256(images.numpy().tobytes()).hexdigest()))
    return time.perf_counter() - t0, n, seen


def part_a(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    www = work / "www-a"
    folder = write_tiny_shards(www / "set", [args.samples_per_shard] * args.shards, image_px=args.image_px)
    server = LoopbackServer(www).start()
    cfg = LoaderConfig(batch_size=32, num_workers=args.workers, image_size=args.image_size, shuffle_buffer=256,
                       decode="pil", persistent_workers=False, prefetch_factor=2, pin_memory=False, seed=0)
    variants = {"local": str(folder), "http": f"{server.url}/set"}
    rates: dict[str, list[float]] = {k: [] for k in variants}
    orders: dict[str, list[Any]] = {}
    try:
        for r in range(args.rounds):
            for name, spec in (variants.items() if r % 2 == 0 else reversed(variants.items())):
                secs, n, seen = epoch(spec, cfg)
                rates[name].append(n / secs)
                orders.setdefault(name, seen)
                same = seen == orders[name]
                log(f"(a) round {r} {name}: {n} samples in {secs:.2f} s = {n / secs:,.0f} samples/s"
                    f"{'' if same else ' (ORDER DIFFERS from its first round)'}")
    finally:
        server.stop()
    med = {k: statistics.median(v) for k, v in rates.items()}
    set_bytes = sum(p.stat().st_size for p in folder.glob("*.tar"))
    return {"samples": args.shards * args.samples_per_shard, "set_bytes": set_bytes, "rounds": args.rounds,
            "workers": args.workers, "samples_per_s": rates, "median": med,
            "ratio_http_over_local": med["http"] / med["local"],
            "same_order": orders["http"] == orders["local"], "batches": len(orders["local"])}


def _train(spec: str, run: Path, conf: Path) -> dict[str, Any]:
    from click.testing import CliRunner

    from gpufeed.cli import cli

    args = ["train", "--shards", spec, "--arch", "resnet18", "--image-size", "32", "--batch-size", "4",
            "--num-workers", "0", "--amp", "off", "--device", "cpu", "--quiet", "--threads", "1", "--measure",
            "--measure-steps", "3", "--storage-probe-s", "1", "--config", str(conf), "--run-dir", str(run)]
    res = CliRunner().invoke(cli, args, catch_exceptions=False)
    s = json.loads((run / "summary.json").read_text())
    v, st, modes = s["verdict"], s["storage"], s["modes"]
    lonly = modes["loader-only"]["samples_per_s"]
    return {"exit": res.exit_code, "storage_mb_per_s": st["bytes_per_s"] / 1e6, "storage_cache": st["cache"],
            "loader_only_samples_per_s": lonly, "real_samples_per_s": modes["real"]["samples_per_s"],
            "compute_samples_per_s": modes["synthetic"]["samples_per_s"], "stall_pct": modes["real"]["stall_pct"],
            "verdict": f"{v['status']} / {v['bound'] or '-'}", "reason": v["reason"], "fixes": v["fixes"]}


def part_b(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    import gpufeed.shardset.source as source
    import gpufeed.measure.storage_probe as storage_probe

    source.CHUNK_BYTES = storage_probe.REMOTE_CHUNK_BYTES = 16 << 10  # scaled with the tiny set (see the docstring)
    www = work / "www-b"
    folder = write_tiny_shards(www / "set", [64], image_px=32)
    mean_bytes = json.loads((folder / "manifest.json").read_text())["mean_sample_bytes"]
    conf = work / "loader.toml"
    conf.write_text("[loader]\nshuffle_buffer = 4\nremote_streams = 1\n")  # one stream, as the proof test
    server = LoopbackServer(www).start()
    shm = Path("/dev/shm")
    dest = Path(tempfile.mkdtemp(prefix="gpufeed-bench-stage-", dir=shm if shm.is_dir() else work))
    try:
        url = f"{server.url}/set"
        server.faults.bandwidth = args.bandwidth
        log(f"(b) train --measure on {url} at {args.bandwidth / 1e3:.0f} KB/s a connection")
        before = _train(url, work / "run-remote", conf)
        server.faults.bandwidth = 0
        from click.testing import CliRunner

        from gpufeed.cli import cli

        res = CliRunner().invoke(cli, ["stage", url, str(dest), "--quiet", "--json"], catch_exceptions=False)
        staged = json.loads(res.stdout.strip().splitlines()[-1])
        log(f"(b) staged to {dest}: {staged['mb_per_s']:.1f} MB/s; train --measure on the staged copy")
        after = _train(str(dest), work / "run-staged", conf)
    finally:
        server.stop()
        shutil.rmtree(dest, ignore_errors=True)
    for rec in (before, after):
        rec["loader_mb_per_s"] = rec["loader_only_samples_per_s"] * mean_bytes / 1e6
    return {"bandwidth_bytes_per_s": args.bandwidth, "set_bytes": sum(p.stat().st_size for p in folder.glob("*.tar")),
            "before": before, "stage_mb_per_s": staged["mb_per_s"], "stage_dest_fs": "tmpfs" if staged["ram_fs"]
            else "disk", "after": after}


def markdown(a: dict[str, Any], b: dict[str, Any]) -> str:
    rng = {k: f"{min(v):,.0f}–{max(v):,.0f}" for k, v in a["samples_per_s"].items()}
    lines = [
        f"**(a) loader over loopback HTTP vs the same local folder** ({a['samples']} samples, "
        f"{a['set_bytes'] / 1e6:.1f} MB, {a['workers']} workers, {a['rounds']} interleaved rounds, one epoch each)",
        "",
        "| source | samples/s median | min–max |",
        "|---|---:|---:|",
        f"| local folder | {a['median']['local']:,.0f} | {rng['local']} |",
        f"| loopback HTTP | {a['median']['http']:,.0f} | {rng['http']} |",
        "",
        f"HTTP / local = {a['ratio_http_over_local']:.2f}; same samples in the same order (labels and image bytes of "
        f"all {a['batches']} batches): **{'yes' if a['same_order'] else 'NO'}**",
        "",
        f"**(b) throttled source ({b['bandwidth_bytes_per_s'] / 1e3:.0f} KB/s a connection, one {b['set_bytes'] / 1e3:.0f}"
        f" KB shard), then `gpufeed stage` to {b['stage_dest_fs']}** (tiny CPU model: resnet18, 32 px, batch 4)",
        "",
        "| set read | storage MB/s (probe) | loader MB/s | loader-only samples/s | compute samples/s | real samples/s "
        "| stall % | verdict |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, r in (("throttled URL", b["before"]), ("staged copy", b["after"])):
        lines.append(f"| {name} | {r['storage_mb_per_s']:,.2f} ({r['storage_cache']}) | {r['loader_mb_per_s']:,.2f} | "
                     f"{r['loader_only_samples_per_s']:,.1f} | {r['compute_samples_per_s']:,.1f} | "
                     f"{r['real_samples_per_s']:,.1f} | {r['stall_pct']:.1f} | {r['verdict']} |")
    lines += ["", f"stage: {b['stage_mb_per_s']:.1f} MB/s; fixes before staging:"]
    lines += [f"- {f}" for f in b["before"]["fixes"]]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--samples-per-shard", type=int, default=64)
    ap.add_argument("--image-px", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=48)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--bandwidth", type=int, default=60_000, help="(b) bytes/s a connection")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpufeed-bench-remote-"))
    try:
        a = part_a(work, args)
        b = part_b(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = markdown(a, b)
    print(text)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = ROOT / "benchmarks" / "results" / f"bench_remote-{stamp}.json"
    write_json(out, {"args": vars(args), "loader_http_vs_local": a, "throttled_then_staged": b, "markdown": text})
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
