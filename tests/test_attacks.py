"""The threat model, as tests: what a downloaded shard set, checkpoint or config must never be able to do.

gpufeed trusts the command line and the user's own config file. It never trusts file names, manifests,
tar headers, image headers or checkpoints (see docs/threat-model.md). Each section below is one attack
that used to work; each test fails without its fix.
"""

from __future__ import annotations

import pytest

# --------------------------------------------------------------------------- 1. a shard file name runs a shell command
def _loader_gzip_shard(path, n: int = 4) -> None:
    """A real gzip tar shard of ``n`` labelled 16x12 JPEG samples at ``path`` (any file name)."""
    import gzip
    import io
    import tarfile

    from tests.conftest import write_image

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for i in range(n):
            img = write_image(path.parent / f".img{i}.jpg", size=(16, 12)).read_bytes()
            for name, data in ((f"k{i:03d}.jpg", img), (f"k{i:03d}.cls", str(i % 2).encode())):
                ti = tarfile.TarInfo(name)
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
    path.write_bytes(gzip.compress(buf.getvalue()))


def test_loader_reads_a_pipe_named_shard_as_a_local_file(tmp_path, monkeypatch):
    """A manifest (built here, past any manifest check) naming ``pipe:touch PWNED;cat x.tgz``: the loader opens
    that file by its local path; webdataset's gopen would have run ``touch PWNED`` in the shell."""
    from gpufeed.config import LoaderConfig
    from gpufeed.loader import ShardLoader
    from gpufeed.manifest import Manifest, ShardInfo
    from gpufeed.world import World

    name = "pipe:touch PWNED;cat x.tgz"
    _loader_gzip_shard(tmp_path / name)
    (tmp_path / "x.tgz").write_bytes((tmp_path / name).read_bytes())  # what `cat` would feed the old reader
    monkeypatch.chdir(tmp_path)  # the shard path is then the bare name, as after `gpufeed index .`
    m = Manifest(prefix="x", classes=["a", "b"], shards=[ShardInfo(name, 4, (tmp_path / name).stat().st_size, None)],
                 num_samples=4, compression="gzip")
    cfg = LoaderConfig(batch_size=2, num_workers=0, image_size=8, decode="pil", pin_memory=False,
                       persistent_workers=False)
    loader = ShardLoader(".", cfg, World.single(), train=False, manifest=m)
    labels = [int(x) for _, lab in loader for x in lab]
    assert labels == [0, 1, 0, 1]
    assert not (tmp_path / "PWNED").exists()



# --------------------------------------------------------------------------- 2. a checkpoint runs code on --resume


# --------------------------------------------------------------------------- 3. a tar header hangs the reader
def _loader_tar_header(name: str, size: bytes | int, typ: bytes = b"0") -> bytes:
    """One ustar header block; ``size`` as an int (octal) or the raw 12-byte field."""
    field = size if isinstance(size, bytes) else b"%011o\0" % size
    hdr = bytearray(512)
    hdr[0:len(name)] = name.encode()
    hdr[100:108] = b"0000644\0"
    hdr[124:136] = field
    hdr[136:148] = b"00000000000\0"
    hdr[156:157] = typ
    hdr[257:263] = b"ustar\0"
    hdr[263:265] = b"00"
    hdr[148:156] = b" " * 8
    hdr[148:156] = b"%06o\0 " % sum(hdr)
    return bytes(hdr)


def _loader_tar_member(name: str, data: bytes, typ: bytes = b"0") -> bytes:
    return _loader_tar_header(name, len(data), typ) + data + bytes(-len(data) % 512)


def _loader_bad_shard(tmp_path, bad: bytes):
    """A 4-sample set: samples 0 and 1 good, then ``bad`` (headers of sample 2), then sample 3."""
    from tests.test_loader import encode, smooth_image, write_set

    shards = write_set(tmp_path / "set", [4], num_classes=2, size=(16, 12))
    jpg = encode(smooth_image(16, 12, 0))
    good = b"".join(_loader_tar_member(f"s{i:05d}.{ext}", data) for i in (0, 1)
                    for ext, data in (("jpg", jpg), ("cls", b"1")))
    last = b"".join(_loader_tar_member(f"s00003.{ext}", data) for ext, data in (("jpg", jpg), ("cls", b"0")))
    (shards / "train-000000.tar").write_bytes(good + bad + last + bytes(1024))
    return shards


def _loader_pax(records: bytes) -> bytes:
    return _loader_tar_member("././@PaxHeader", records, b"x")


def _loader_pax_record(key: str, value: str) -> bytes:
    body = f" {key}={value}\n"
    n = len(body) + 2
    n += len(str(n)) - 2
    return f"{n}{body}".encode()


_LOADER_BAD_HEADERS = {
    # pax size -1536 on a member the reader seeks over: it seeked back onto the same header forever
    "negative pax size": (_loader_pax(_loader_pax_record("size", "-1536")) + _loader_tar_member("s00002.json", b"{}"),
                          r"'s00002\.json'.*pax size '-1536'"),
    # a size of 8 GiB on a member the reader skips: it seeked past the end and read the shard as short
    "huge size": (_loader_tar_header("s00002.json", 8 ** 11 - 1), r"'s00002\.json'.*runs past the end"),
    # a pax record without a valid length: the parser raised a bare ValueError or looped
    "junk pax record": (_loader_pax(b"zz junk\n") + _loader_tar_member("s00002.jpg", b"x"),
                        r"'././@PaxHeader'.*malformed pax record"),
    # GNU base-256 size -512 (0xff, two's complement): read as a huge positive size and skipped
    "negative base-256 size": (_loader_tar_header("s00002.json", b"\xff" * 10 + b"\xfe\x00"),
                               r"'s00002\.json'.*negative size -512"),
}


@pytest.mark.timeout(20)
@pytest.mark.parametrize("attack", sorted(_LOADER_BAD_HEADERS))
def test_loader_malformed_tar_header_is_a_data_error(tmp_path, attack):
    from gpufeed.errors import DataError
    from gpufeed.loader import build_loader
    from gpufeed.world import World
    from tests.test_loader import cfg

    bad, reason = _LOADER_BAD_HEADERS[attack]
    shards = _loader_bad_shard(tmp_path, bad)
    loader = build_loader(shards, cfg(batch_size=2), World.single(), train=False)
    with pytest.raises(DataError, match=r"train-000000\.tar.*" + reason) as info:
        list(loader)
    assert "\n" not in str(info.value)
    # skipped: the rest of the segment is counted - samples 1..3, as sample 1 ends only where a readable
    # header begins - and the epoch still ends, its 4 samples filled by re-reading sample 0
    loader = build_loader(shards, cfg(batch_size=2, on_error="skip"), World.single(), train=False)
    assert len(list(loader)) == 2 and loader.num_skipped == 3 and loader.num_repeated == 3



# --------------------------------------------------------------------------- 9. a tiny image asks for gigabytes
@pytest.fixture(scope="module")
def _loader_bomb_png() -> bytes:
    """A real 13,000 x 13,000 PNG of about 20 KB (1-bit, all black): about 0.5 GB once decoded to RGB."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (13000, 13000)).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize("decode", ["pil", "pil-draft", "simplejpeg", "gpu"])
def test_loader_refuses_an_image_over_max_pixels_before_decoding(tmp_path, _loader_bomb_png, decode):
    from gpufeed.errors import DataError
    from gpufeed.loader import build_loader
    from gpufeed.world import World
    from tests.test_loader import cfg, encode, smooth_image, write_set

    if decode == "simplejpeg":
        pytest.importorskip("simplejpeg")
    assert len(_loader_bomb_png) < 100_000

    def make(n):
        return ("png", _loader_bomb_png) if n == 1 else ("jpg", encode(smooth_image(16, 12, n)))

    shards = write_set(tmp_path / "bomb", [4], num_classes=2, make=make)
    loader = build_loader(shards, cfg(batch_size=2, decode=decode), World.single(), train=False)
    with pytest.raises(DataError, match=r"'s00001\.png' in shard .*train-000000\.tar.*13000 x 13000.*"
                                        r"max_pixels = 89478485"):
        list(loader)
    loader = build_loader(shards, cfg(batch_size=2, decode=decode, on_error="skip"), World.single(), train=False)
    assert len(list(loader)) == 2 and loader.num_skipped == 1


def test_loader_max_pixels_is_configurable_on_the_gpu_path(tmp_path):
    """A JPEG the device would decode is refused from its header too (here a 40 x 32 JPEG over max_pixels 1000)."""
    from gpufeed.errors import DataError
    from gpufeed.loader import build_loader
    from gpufeed.world import World
    from tests.test_loader import cfg, write_set

    shards = write_set(tmp_path / "set", [4], num_classes=2)  # 40 x 32 JPEGs
    loader = build_loader(shards, cfg(batch_size=2, decode="gpu", max_pixels=1000), World.single(), train=False)
    with pytest.raises(DataError, match=r"'s00000\.jpg'.*40 x 32 = 1280 pixels, over max_pixels = 1000"):
        list(loader)
