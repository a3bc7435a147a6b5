"""What a progressive JPEG of thousands of scans costs each decoder, and what gpufeed's scan limit leaves of it.

Builds a flat ``--side`` x ``--side`` progressive JPEG (Pillow, quality 90) whose last scan is repeated ``--copies``
times (every decoder reads each repeat as another pass over the whole image), then times, once each, the libraries
themselves (Pillow ``load``, simplejpeg ``decode_jpeg``, nvImageCodec's CPU decode when installed) and gpufeed's
``decode_into`` on every CPU path, which refuses the file from its markers (``shardset.images.MAX_JPEG_SCANS``).
Wall seconds, one process; a library's answer (decoded / its error) is printed beside its time. Never asserts.

    .venv/bin/python benchmarks/bench_scan_bomb.py --side 2000 --copies 2000
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def scan_bomb(side: int, copies: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), (120, 130, 140)).save(buf, "JPEG", quality=90, progressive=True)
    data = buf.getvalue()
    last = data.rindex(b"\xff\xda")  # a flat image's last scan holds no FF byte: it runs to the end marker
    return data[:-2] + data[last:-2] * copies + b"\xff\xd9"


def timed(label: str, fn) -> None:  # noqa: ANN001
    t = time.perf_counter()
    try:
        fn()
        answer = "decoded"
    except Exception as exc:  # noqa: BLE001 - reported
        answer = f"{type(exc).__name__}: {str(exc)[:90]}"
    print(f"  {label:34s} {time.perf_counter() - t:8.3f} s  {answer}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--side", type=int, default=2000)
    ap.add_argument("--copies", type=int, default=2000)
    args = ap.parse_args()
    from PIL import Image

    from gpufeed.loader import decode as dec

    data = scan_bomb(args.side, args.copies)
    scans = data.count(b"\xff\xda")
    print(f"{args.side} x {args.side} progressive JPEG, {len(data):,} bytes, {scans} scans")
    print("the libraries alone:")
    timed("Pillow open + load", lambda: Image.open(io.BytesIO(data)).load())
    try:
        import simplejpeg
        timed("simplejpeg decode_jpeg", lambda: simplejpeg.decode_jpeg(data, colorspace="RGB"))
    except ImportError:
        print("  simplejpeg: not installed")
    if dec.roi_available():
        nv = dec._import_nvimgcodec()
        d = nv.Decoder(device_id=nv.NVIMGCODEC_DEVICE_CPU_ONLY, max_num_cpu_threads=1,
                       backends=[nv.Backend(nv.BackendKind.CPU_ONLY)])
        timed("nvImageCodec CPU decode", lambda: np.asarray(d.decode(nv.CodeStream(data)).cpu()))
    print("gpufeed's decode_into (a 300 x 300 train crop into a 224 row):")
    out = np.empty((224, 224, 3), np.uint8)
    crop = dec.Crop((0.0, 0.0, 300.0, 300.0))
    for method in ("pil", "pil-draft", "simplejpeg", "roi"):
        if method == "roi" and not dec.roi_available():
            continue
        timed(f"decode = {method!r}", lambda m=method: dec.decode_into(data, "jpg", m, lambda *_: crop, 224, out))


if __name__ == "__main__":
    main()
