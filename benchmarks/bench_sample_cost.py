"""Where one training sample's CPU goes, part by part, and what the Y/Cb/Cr-planes lever (issue 21) could save.

One process, one torch thread, CPU time (``time.process_time``) per image, min of ``--repeats`` passes over the same
images; every part is measured in each of ``--rounds`` interleaved rounds and the min over rounds is printed:

- ``tar read``: gpufeed's tar reader over ``--shards`` (headers checked, ``.jpg`` + ``.cls`` read), per sample;
- ``decode RGB``: simplejpeg's whole-image decode (the default path's decode);
- ``decode + crop + resize``: ``gpufeed.loader.decode.decode_into`` with a train crop (``simplejpeg``; ``roi``
  through gpufeed's compiled region decoder where it loaded, and through nvImageCodec's where that is installed),
  into a 224 row;
- ``resize``: the crop + antialiased resize + flip of an already decoded image (torch's uint8 kernel);
- ``roi by crop area`` (gpufeed's region decoder, where it loaded): per train crop no DCT scale reduces, the region
  decode's time over simplejpeg's whole decode of the same image (each the best of 3, interleaved), median per
  fifth of the image's area: what ``decode.ROI_MAX_AREA`` is set from;
- with PyTurboJPEG 1.x and a system libturbojpeg (``apt-get install libturbojpeg0``, ``pip install
  'PyTurboJPEG<2'``; neither is a gpufeed dependency): the same library's RGB decode, its decode to Y/Cb/Cr planes
  (``tjDecompressToYUVPlanes``: no chroma upsampling, no colour conversion) and to GRAY, per chroma subsampling;
  and torch's resize of the planes (Y at the crop's size, Cb and Cr at half) against one RGB resize.

Images: the ``.jpg`` members of the first shards of ``--shards``. Writes JSON to ``--out``. Never asserts.

    .venv/bin/python benchmarks/bench_sample_cost.py --shards bench-data/peers-shards
"""

from __future__ import annotations

import argparse
import datetime as dt
import glob
import json
import os
import platform
import random
import shlex
import sys
import tarfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def cpu_ms(items: list, fn: Callable[[int, Any], Any], repeats: int) -> float:
    """Min over ``repeats`` passes of the CPU milliseconds per item."""
    best = float("inf")
    for _ in range(repeats):
        c0 = time.process_time()
        for i, x in enumerate(items):
            fn(i, x)
        best = min(best, (time.process_time() - c0) / len(items) * 1e3)
    return best


def jpegs(paths: list[str], limit: int) -> list[bytes]:
    out: list[bytes] = []
    for p in paths:
        with tarfile.open(p) as t:
            for m in t:
                if m.name.endswith(".jpg"):
                    f = t.extractfile(m)
                    if f is not None:
                        out.append(f.read())
                if len(out) >= limit:
                    return out
    return out


def subsampling(data: bytes) -> str | None:
    import simplejpeg

    try:
        h = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    return h[3] if h[2] == "YCbCr" else ("gray" if h[2] == "Gray" else None)


def parts(args: argparse.Namespace, paths: list[str], datas: list[bytes]) -> dict[str, float]:
    """One round: every part once (each the min of ``repeats`` passes)."""
    import simplejpeg
    import torch
    import torch.nn.functional as F

    from gpufeed.loader import decode as dec
    from gpufeed.loader.reader import READ_IMAGE_EXTENSIONS
    from gpufeed.shardset.tar import iter_samples

    r = args.repeats
    out = np.empty((224, 224, 3), np.uint8)
    res: dict[str, float] = {}
    counted = [0]

    def read_all(_i: int, p: str) -> None:
        for _ in iter_samples(p, frozenset({"jpg", "cls"}), READ_IMAGE_EXTENSIONS):
            counted[0] += 1
    read_all(0, paths[0])  # the shard's sample count (and the file in the page cache)
    per_pass = counted[0]
    res["tar read"] = cpu_ms(paths[:1], read_all, r) / max(per_pass, 1)
    res["decode RGB (simplejpeg)"] = cpu_ms(datas, lambda i, d: simplejpeg.decode_jpeg(d, colorspace="RGB"), r)
    crop = lambda i: (lambda w, h: dec.train_crop(w, h, random.Random(i)))  # noqa: E731 - the same crop per image
    res["decode + crop + resize (simplejpeg)"] = cpu_ms(
        datas, lambda i, d: dec.decode_into(d, "jpg", "simplejpeg", crop(i), 224, out), r)
    from gpufeed.loader import jpegroi

    native = jpegroi.region_decoder
    if native() is not None:
        res["decode + crop + resize (roi, gpufeed's decoder)"] = cpu_ms(
            datas, lambda i, d: dec.decode_into(d, "jpg", "roi", crop(i), 224, out), r)
    jpegroi.region_decoder = lambda: None  # the nvImageCodec backend, as where gpufeed's did not build
    try:
        if dec.roi_available():
            res["decode + crop + resize (roi, nvImageCodec)"] = cpu_ms(
                datas, lambda i, d: dec.decode_into(d, "jpg", "roi", crop(i), 224, out), r)
    finally:
        jpegroi.region_decoder = native
    arrs = [simplejpeg.decode_jpeg(d, colorspace="RGB") for d in datas]
    crops = [dec.train_crop(a.shape[1], a.shape[0], random.Random(i)) for i, a in enumerate(arrs)]
    res["crop + resize + flip"] = cpu_ms(arrs, lambda i, a: dec.resize_array_into(a, crops[i], 224, out), r)
    try:
        import turbojpeg
        tj = turbojpeg.TurboJPEG()
    except Exception as exc:  # noqa: BLE001 - optional: PyTurboJPEG 1.x + a system libturbojpeg
        res["planes: skipped"] = float("nan")
        print(f"planes: skipped ({type(exc).__name__}: {str(exc)[:120]})", file=sys.stderr)
        return res
    for sub in ("420", "444"):
        ds = [d for d in datas if subsampling(d) == sub]
        if len(ds) < 20:
            continue
        res[f"{sub}: turbojpeg RGB"] = cpu_ms(ds, lambda i, d: tj.decode(d, pixel_format=turbojpeg.TJPF_RGB), r)
        res[f"{sub}: turbojpeg planes"] = cpu_ms(ds, lambda i, d: tj.decode_to_yuv_planes(d), r)
        res[f"{sub}: turbojpeg GRAY"] = cpu_ms(ds, lambda i, d: tj.decode(d, pixel_format=turbojpeg.TJPF_GRAY), r)
    # resizing planes: Y at the crop's size, Cb and Cr (4:2:0) at half, against one RGB resize of the same crop
    side = int(args.crop_side)
    rgb = torch.randint(0, 255, (1, 3, side, side), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 255, (1, 1, side, side), dtype=torch.uint8)
    c = torch.randint(0, 255, (1, 1, side // 2, side // 2), dtype=torch.uint8)

    def rs(x: Any, s: int) -> Any:
        return F.interpolate(x, size=(s, s), mode="bilinear", antialias=True, align_corners=False)
    reps = [None] * 200
    res[f"resize RGB {side}->224"] = cpu_ms(reps, lambda i, _: rs(rgb, 224), r)
    res[f"resize planes {side}->224 (Y) + 2x {side // 2}->112"] = cpu_ms(
        reps, lambda i, _: (rs(y, 224), rs(c, 112), rs(c, 112)), r)
    return res


def roi_bins(datas: list[bytes]) -> dict[str, dict[str, float]]:
    """Region decode over whole decode, median per fifth of the image's area (see the module's docstring)."""
    import simplejpeg

    from gpufeed.loader import decode as dec
    from gpufeed.loader import jpegroi

    mod = jpegroi.region_decoder()
    if mod is None:
        return {}
    buf = np.empty(64 << 20, np.uint8)
    rng = random.Random(0)
    bins: dict[int, list[float]] = {}
    for d in datas:
        h, w = simplejpeg.decode_jpeg_header(d)[:2]
        crop = dec.train_crop(w, h, rng)
        if dec.draft_scale(crop, 224) > 1:
            continue
        box = dec.pixel_box(crop.box, w, h)
        l, t, r, b = box
        region = whole = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            jpegroi.decode_region(mod, d, box, buf)
            t1 = time.perf_counter()
            simplejpeg.decode_jpeg(d, colorspace="RGB")
            t2 = time.perf_counter()
            region, whole = min(region, t1 - t0), min(whole, t2 - t1)
        bins.setdefault(min(int((r - l) * (b - t) / (w * h) * 5), 4), []).append(region / whole)
    return {f"{k * 20}-{k * 20 + 20}%": {"crops": len(v), "median": float(np.median(v))} for k, v in sorted(bins.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", required=True, help="a gpufeed shard folder (its *.tar)")
    ap.add_argument("--images", type=int, default=500, help="JPEGs taken from the first shards")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--crop-side", type=int, default=320, help="the square crop the planes-resize check uses")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    paths = sorted(glob.glob(os.path.join(args.shards, "*.tar")))
    if not paths:
        sys.exit(f"no *.tar in {args.shards}")
    datas = [d for d in jpegs(paths, args.images) if subsampling(d) is not None]
    rounds = [parts(args, paths, datas) for _ in range(args.rounds)]
    best = {k: min(r[k] for r in rounds) for k in rounds[0]}
    bins = roi_bins(datas)
    print(f"{len(datas)} images from {args.shards}; CPU ms per image, min of {args.repeats} passes x {args.rounds} "
          f"rounds")
    for k, v in best.items():
        print(f"  {k:48s} {v:7.3f}")
    for k, v in bins.items():
        print(f"  roi by crop area {k:8s} region / whole decode {v['median']:.2f} ({v['crops']} crops)")
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / \
        f"sample_cost-{dt.datetime.now(dt.timezone.utc):%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    import psutil
    machine = {"machine": _cpu_name(), "usable_cpus": len(os.sched_getaffinity(0)),
               "ram_bytes": int(psutil.virtual_memory().total), "hostname": platform.node()}
    out.write_text(json.dumps({"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                               "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
                               "shards": args.shards, "images": len(datas), "repeats": args.repeats,
                               "rounds_count": args.rounds, "machine": machine, "rounds": rounds, "min": best,
                               "roi_bins": bins},
                              indent=1))
    print(f"wrote {out}")


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
