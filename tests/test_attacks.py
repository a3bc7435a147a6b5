"""The threat model, as tests: what a downloaded shard set, checkpoint or config must never be able to do.

gpufeed trusts the command line and the user's own config file. It never trusts file names, manifests,
tar headers, image headers or checkpoints (see docs/threat-model.md). Each section below is one attack
that used to work; each test fails without its fix.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------- 1. a shard file name runs a shell command
@pytest.mark.parametrize("name", ["pipe:touch PWNED;cat x.tar", "http://evil.invalid/x.tar"])
def test_remote_manifest_naming_a_command_or_url_is_refused(http_server, tmp_path, monkeypatch, name):
    """A manifest served over HTTP whose shard name is a ``pipe:`` command or a URL: refused before any shard is
    opened; nothing runs and nothing but the manifest is fetched (names are never URLs or commands)."""
    import json as json_module

    from gpufeed.core.errors import DataError
    from gpufeed.shardset.source import open_set
    from tests.common.cli import invoke
    from tests.common.shards import write_tiny_shards

    folder = write_tiny_shards(http_server.root / "set", [2], image_px=16)
    m = json_module.loads((folder / "manifest.json").read_text())
    m["shards"][0]["name"] = name
    (folder / "manifest.json").write_text(json_module.dumps(m))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=r"shard name .* is refused: it holds"):
        open_set(f"{http_server.url}/set")
    r = invoke(["verify", f"{http_server.url}/set"], expect=2)
    assert "is refused" in r.stderr
    assert not (tmp_path / "PWNED").exists()
    assert {p for _, p, _ in http_server.requests} == {"/set/manifest.json"}


def _loader_gzip_shard(path, n: int = 4) -> None:
    """A real gzip tar shard of ``n`` labelled 16x12 JPEG samples at ``path`` (any file name)."""
    from tests.common.shards import write_image, write_tar

    members = []
    for i in range(n):
        img = write_image(path.parent / f".img{i}.jpg", size=(16, 12)).read_bytes()
        members += [(f"k{i:03d}.jpg", img), (f"k{i:03d}.cls", str(i % 2).encode())]
    write_tar(path, members, gz=True)


def test_loader_reads_a_pipe_named_shard_as_a_local_file(tmp_path, monkeypatch):
    """A manifest (built here, past any manifest check) naming ``pipe:touch PWNED;cat x.tgz``: the loader opens
    that file by its local path; webdataset's gopen would have run ``touch PWNED`` in the shell."""
    from gpufeed.config import LoaderConfig
    from gpufeed.loader import ShardLoader
    from gpufeed.shardset.manifest import Manifest, ShardInfo
    from gpufeed.core.world import World

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



PIPE_NAME = "pipe:touch PWNED;cat data.tgz"
"""A file name webdataset's gopen would run as a shell command (it creates ./PWNED)."""


def test_index_refuses_a_shard_file_named_like_a_pipe_command(tmp_path, monkeypatch):
    import shutil

    from tests.common.cli import invoke
    from tests.common.shards import WDS_SAMPLE

    folder = tmp_path / "foreign"
    folder.mkdir()
    shutil.copy(WDS_SAMPLE, folder / "data.tgz")
    shutil.copy(WDS_SAMPLE, folder / PIPE_NAME)  # a real shard under the hostile name
    monkeypatch.chdir(folder)
    res = invoke(["index", "."], expect=2)
    (line,) = res.stderr.strip().splitlines()
    assert PIPE_NAME in line and "rename it" in line and "':'" in line
    assert not (folder / "manifest.json").exists()
    assert not (folder / "PWNED").exists()


def _manifest(folder, **changes):
    """A valid hand-written manifest for one .tgz shard of 90 samples, with ``changes`` applied."""
    import json

    d = {"format": "gpufeed-shards", "format_version": 1, "prefix": "data", "classes": [str(i) for i in range(10)],
         "shards": [{"name": "data.tgz", "num_samples": 90, "bytes": 1, "sha256": None}], "num_samples": 90,
         "created_by": "gpufeed index", "compression": "gzip"}
    d.update(changes)
    (folder / "manifest.json").write_text(json.dumps(d))
    return folder


@pytest.mark.parametrize("name", [PIPE_NAME + ".tgz", "s3://bucket/data.tgz", "http:data.tgz", "data-{0..9}.tgz",
                                  "../data.tgz", "-data.tgz", "data\x00.tgz", "|data.tgz", "data.zip",
                                  "a" * 300 + ".tgz"])
def test_manifest_refuses_shard_names_that_are_not_plain_file_names(tmp_path, monkeypatch, name):
    from gpufeed.core.errors import DataError
    from gpufeed.shardset.manifest import read_manifest

    monkeypatch.chdir(tmp_path)
    _manifest(tmp_path, shards=[{"name": name, "num_samples": 90, "bytes": 1, "sha256": None}])
    with pytest.raises(DataError) as exc:
        read_manifest(tmp_path)
    assert "shard name" in str(exc.value) and "refused" in str(exc.value) and "\n" not in str(exc.value)
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("root", ["pipe:touch PWNED;cat", "s3://bucket/set", "file://x", "/data/{a,b}", 7])
def test_manifest_refuses_a_root_that_is_not_a_local_folder(tmp_path, root):
    from gpufeed.core.errors import DataError
    from gpufeed.shardset.manifest import read_manifest

    _manifest(tmp_path, root=root)
    with pytest.raises(DataError, match="root .* is refused"):
        read_manifest(tmp_path)


def test_manifest_naming_a_pipe_shard_never_reaches_the_loader(tmp_path, monkeypatch):
    import shutil

    from gpufeed.config import LoaderConfig
    from gpufeed.core.errors import DataError
    from gpufeed.loader import build_loader
    from gpufeed.core.world import World
    from tests.common.cli import invoke
    from tests.common.shards import WDS_SAMPLE

    shutil.copy(WDS_SAMPLE, tmp_path / PIPE_NAME)
    _manifest(tmp_path, shards=[{"name": PIPE_NAME, "num_samples": 90, "bytes": 1, "sha256": None}])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match="shard name"):
        build_loader(".", LoaderConfig(batch_size=8, num_workers=0, image_size=16), World.single())
    res = invoke(["verify", "."], expect=2)
    assert len(res.stderr.strip().splitlines()) == 1 and "shard name" in res.stderr
    assert not (tmp_path / "PWNED").exists()


def test_manifest_that_is_a_fifo_is_refused_not_waited_on(tmp_path):
    """open() of a FIFO blocks until a writer comes: a shard set must not be able to hang every reader."""
    import os

    from gpufeed.core.errors import DataError
    from gpufeed.shardset.manifest import first_duplicate, read_manifest

    os.mkfifo(tmp_path / "manifest.json")
    with pytest.raises(DataError, match="manifest.json is not a regular file"):
        read_manifest(tmp_path)
    assert first_duplicate(["a", "b", "c", "b", "a"]) == "b" and first_duplicate(["a", "b"]) is None


# --------------------------------------------------------------------------- 2. a checkpoint runs code on --resume


class _Payload:
    """Unpickling this creates ``marker``: the stand-in for any code a crafted checkpoint would run."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


_TRAIN = ["--arch", "resnet18", "--image-size", "32", "--batch-size", "4", "--num-workers", "0", "--amp", "off",
          "--device", "cpu", "--quiet", "--threads", "1"]


def test_resume_refuses_a_checkpoint_that_pickles_code(tmp_path):
    import pickle

    import torch

    from tests.common.cli import invoke
    from tests.common.shards import write_tiny_shards

    shards = write_tiny_shards(tmp_path / "shards", [16, 16, 16, 16])
    for container in ("torch.save", "raw pickle"):
        marker = tmp_path / f"PWNED-{container}"
        ck = tmp_path / f"ck-{container}"
        ck.mkdir()
        state = {"format": "gpufeed-train-checkpoint", "version": 2, "arch": "resnet18", "num_classes": 4,
                 "step": 0, "payload": _Payload(str(marker))}
        if container == "torch.save":
            torch.save(state, ck / "last.pt")
        else:
            (ck / "last.pt").write_bytes(pickle.dumps(state))
        res = invoke(["train", "--shards", shards, *_TRAIN, "--steps", "1", "--checkpoint-dir", ck, "--resume",
                      "--run-dir", tmp_path / "run"], expect=2)
        err = res.stderr.strip().splitlines()
        assert len(err) == 1 and str(ck / "last.pt") in err[0] and "Traceback" not in res.stderr, res.stderr
        assert ("is refused" if container == "torch.save" else "is not a gpufeed checkpoint") in err[0]
        assert not marker.exists(), container


def test_resume_refuses_a_compressed_checkpoint_before_inflating_it(tmp_path):
    """A 64 MiB record stored DEFLATE-compressed fits in ~70 KB; torch.load would inflate it in memory."""
    import zipfile

    import torch

    from gpufeed.core.errors import DataError
    from gpufeed.train.checkpoint import read_checkpoint

    plain, bomb = tmp_path / "plain.pt", tmp_path / "last.pt"
    torch.save({"format": "gpufeed-train-checkpoint", "junk": torch.zeros(64 << 20, dtype=torch.uint8)}, plain)
    with zipfile.ZipFile(plain) as zi, zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as zo:
        for info in zi.infolist():
            zo.writestr(info.filename, zi.read(info.filename))
    assert bomb.stat().st_size < 1 << 20
    with pytest.raises(DataError, match=r"last.pt is not a gpufeed checkpoint: record .* is compressed"):
        read_checkpoint(bomb)


def test_values_from_a_checkpoint_are_shown_bounded():
    """A checkpoint can hold a list nested 100,000 deep; naming it in a message must not recurse."""
    from gpufeed.train.checkpoint import _short

    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    assert _short(deep) == "[[[[...]]]]"
    assert len(_short("x" * 10_000)) <= 60


def test_a_checkpoint_holds_only_tensors_and_plain_values_and_resumes(tmp_path):
    """What gpufeed writes loads under weights_only=True, and --resume continues from it."""
    import torch

    from tests.common.cli import invoke, invoke_json
    from tests.common.shards import write_tiny_shards

    shards = write_tiny_shards(tmp_path / "shards", [16, 16, 16, 16])
    ck = tmp_path / "ck"
    invoke(["train", "--shards", shards, *_TRAIN, "--steps", "1", "--checkpoint-dir", ck, "--run-dir", tmp_path / "a"],
           expect=None)  # exit 1 when the verdict says starved

    def plain(v):
        if isinstance(v, dict):
            return all(isinstance(k, (str, int)) and plain(x) for k, x in v.items())
        if isinstance(v, (list, tuple)):
            return all(plain(x) for x in v)
        return v is None or isinstance(v, (bool, int, float, str, torch.Tensor))

    state = torch.load(ck / "last.pt", map_location="cpu", weights_only=True)
    assert state["step"] == 1 and plain(state)
    s = invoke_json(["train", "--shards", shards, *_TRAIN, "--steps", "2", "--checkpoint-dir", ck, "--resume",
                     "--run-dir", tmp_path / "b"], expect=None)
    assert s["start_step"] == 1 and s["step"] == 2


# --------------------------------------------------------------------------- 3. a tar header hangs the reader
@pytest.mark.parametrize("compress", [True, False])
def test_a_member_over_the_cap_is_refused_before_it_is_read(tmp_path, monkeypatch, compress):
    """A gzip bomb (a small .tgz whose k.jpg inflates to hundreds of MiB) or a huge plain member: the loader refuses
    a member declaring more than shardset.tar.MAX_MEMBER_BYTES before reading it (cap lowered to 1 MiB here);
    under skip the samples it cost are counted. The gzip path used to read any size."""
    import dataclasses
    import gzip

    import gpufeed.shardset.tar as tar
    from gpufeed.core.errors import DataError
    from gpufeed.loader import build_loader
    from gpufeed.shardset.manifest import read_manifest, write_manifest
    from gpufeed.core.world import World
    from tests.common.shards import cfg, encode, sizes_as_found, smooth_image, write_set

    monkeypatch.setattr(tar, "MAX_MEMBER_BYTES", 1 << 20)
    shards = write_set(tmp_path / "set", [4], num_classes=4, size=(16, 12),
                       make=lambda n: ("jpg", b"\0" * (2 << 20) if n == 2 else encode(smooth_image(16, 12, n))))
    name = "train-000000.tar"
    if compress:
        m = read_manifest(shards)
        (shards / "train-000000.tgz").write_bytes(gzip.compress((shards / name).read_bytes()))
        (shards / name).unlink()
        (shards / "manifest.json").unlink()
        write_manifest(shards, dataclasses.replace(
            m, shards=[dataclasses.replace(m.shards[0], name="train-000000.tgz")], compression="gzip"))
        name = "train-000000.tgz"
        assert (shards / name).stat().st_size < 64 << 10  # 2 MiB of zeros, compressed
    sizes_as_found(shards)  # a crafted shard comes with a manifest that matches it
    with pytest.raises(DataError, match=re.escape(name) + r" is malformed .*'s00002\.jpg'.*member is 2097152 "
                                        r"bytes, more than the 1048576") as err:
        list(build_loader(shards, cfg(batch_size=1, shuffle_buffer=0), World.single(), train=False))
    assert "\n" not in str(err.value)
    loader = build_loader(shards, cfg(batch_size=1, shuffle_buffer=0, on_error="skip"), World.single(), train=False)
    labels = [int(x) for _, y in loader for x in y]
    # sample 1 ends only where s00002.jpg begins: samples 1..3 are lost, sample 0 fills the epoch
    assert labels == [0, 0, 0, 0] and loader.num_skipped == 3


def _agree_member(name: str, data: bytes, typ: bytes = b"0", magic: bytes = b"ustar\x0000", prefix: bytes = b"",
                  signed: bool = False) -> bytes:
    h = bytearray(512)
    n = name.encode("utf-8", "surrogateescape")
    h[0:len(n)] = n
    h[100:108] = b"0000644\0"
    h[124:136] = b"%011o\0" % len(data)
    h[136:148] = b"00000000000\0"
    h[156:157] = typ
    h[257:265] = magic
    h[345:345 + len(prefix)] = prefix
    h[148:156] = b" " * 8
    chk = sum(x - 256 if signed and x > 127 else x for x in h)
    h[148:156] = b"%06o\0 " % chk
    return bytes(h) + data + bytes(-len(data) % 512)


def _agree_pax(key: str, value: str, typ: bytes = b"x") -> bytes:
    body = f" {key}={value}\n"
    n = len(body) + len(str(len(body) + 2))
    return _agree_member("././@PaxHeader", f"{n}{body}".encode(), typ)


def _agree_shard(tmp_path, middle: bytes):
    """Samples s0 and s1, then ``middle``, then sample s3, in a folder of its own (no manifest)."""
    from tests.common.shards import encode, smooth_image

    jpg = encode(smooth_image(16, 12, 0))
    blob = b"".join(_agree_member(f"s{i}.{e}", d) for i in (0, 1) for e, d in (("jpg", jpg), ("cls", b"1")))
    blob += middle + _agree_member("s3.jpg", jpg) + _agree_member("s3.cls", b"0") + bytes(1024)
    folder = tmp_path / "set"
    folder.mkdir()
    (folder / "p-000000.tar").write_bytes(blob)
    return folder, jpg


def _agree_three(folder, reason: str | None, num_samples: int = 4):
    """index, verify and the loader on ``folder``: all refuse with ``reason`` (a regex), or (None) all read
    ``num_samples`` samples."""
    import shutil

    from gpufeed.core.errors import DataError
    from gpufeed.loader import build_loader
    from gpufeed.shardset.manifest import Manifest, ShardInfo, write_manifest
    from gpufeed.core.world import World
    from tests.common.cli import invoke
    from tests.common.shards import cfg

    shard = folder / "p-000000.tar"
    r = invoke(["index", str(folder)], expect=None)
    if reason is None:
        assert r.exit_code == 0, r.output
        assert f"{num_samples} samples" in r.output
    else:
        assert r.exit_code == 2 and re.search(reason, r.output), r.output
        # a manifest that promises the samples (as an older index wrote): verify and the loader refuse too
        man = Manifest(prefix="p", classes=["0", "1"], shards=[ShardInfo("p-000000.tar", 4, shard.stat().st_size, None)],
                       num_samples=4, total_bytes=shard.stat().st_size, mean_sample_bytes=1.0, url_pattern="",
                       created_by="gpufeed index", gpufeed_version="0")
        write_manifest(folder, man)
    r = invoke(["verify", str(folder)], expect=None)
    if reason is None:
        assert r.exit_code == 0, r.output
    else:
        assert r.exit_code == 1 and re.search(reason, r.output), r.output
    loader = build_loader(folder, cfg(batch_size=1), World.single(), train=False)
    if reason is None:
        assert sum(len(y) for _, y in loader) == num_samples
    else:
        with pytest.raises(DataError, match=r"p-000000\.tar.*" + reason):
            list(loader)
    shutil.rmtree(folder)


_DISAGREE = {
    # tarfile (index/verify) took the first path, the loader the second: a sample renamed, lost or added
    "two pax headers": (_agree_pax("path", "s2.jpg") + _agree_pax("path", "s1.png"), "second extended header"),
    "long name then pax": (_agree_member("././@LongLink", b"s2.jpg\0", b"L") + _agree_pax("path", "s1.png"),
                           "second extended header"),
    "global pax path": (_agree_pax("path", "s2.jpg", b"g"), "global pax header sets 'path'"),
    "sparse member": (b"", "GNU sparse member"),
    "symlink with data": (b"", "with 512 bytes of data"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("attack", sorted(_DISAGREE))
def test_tar_readers_refuse_what_they_would_read_differently(tmp_path, attack):
    from tests.common.shards import encode, smooth_image

    jpg = encode(smooth_image(16, 12, 0))
    middle, reason = _DISAGREE[attack]
    if attack == "sparse member":
        middle = _agree_member("s2.jpg", jpg, b"S")
    elif attack == "symlink with data":  # tarfile reads the "data" as the next header, the loader skips it
        middle = _agree_member("s2.lnk", _agree_member("s2.jpg", b""), b"2")
    elif attack != "global pax path":
        middle += _agree_member("zz", jpg)
    middle += _agree_member("s2.cls", b"0")
    folder, _ = _agree_shard(tmp_path, middle)
    _agree_three(folder, reason)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("magic", [b"ustar\x0000", b"ustar  \0", bytes(8)])
def test_tar_readers_agree_on_the_prefix_field_and_signed_checksum(tmp_path, magic):
    # the prefix joins the name whatever the magic (as tarfile does); a signed checksum is valid
    from tests.common.shards import encode, smooth_image

    jpg = encode(smooth_image(16, 12, 0))
    middle = (_agree_member("s2.jpg", jpg, magic=magic, prefix=b"sub")
              + _agree_member("s2.cls", b"0", magic=magic, prefix=b"sub")
              + _agree_member("k\udce9.jpg", jpg, signed=True) + _agree_member("k\udce9.cls", b"1", signed=True))
    folder, _ = _agree_shard(tmp_path, middle)
    _agree_three(folder, None, num_samples=5)


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
    from tests.common.shards import encode, sizes_as_found, smooth_image, write_set

    shards = write_set(tmp_path / "set", [4], num_classes=2, size=(16, 12))
    jpg = encode(smooth_image(16, 12, 0))
    good = b"".join(_loader_tar_member(f"s{i:05d}.{ext}", data) for i in (0, 1)
                    for ext, data in (("jpg", jpg), ("cls", b"1")))
    last = b"".join(_loader_tar_member(f"s00003.{ext}", data) for ext, data in (("jpg", jpg), ("cls", b"0")))
    (shards / "train-000000.tar").write_bytes(good + bad + last + bytes(1024))
    sizes_as_found(shards)  # a crafted shard comes with a manifest that matches it
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
    from gpufeed.core.errors import DataError
    from gpufeed.loader import build_loader
    from gpufeed.core.world import World
    from tests.common.shards import cfg

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
    from gpufeed.core.errors import DataError
    from gpufeed.loader import build_loader
    from gpufeed.core.world import World
    from tests.common.shards import cfg, encode, smooth_image, write_set

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
    from gpufeed.core.errors import DataError
    from gpufeed.loader import build_loader
    from gpufeed.core.world import World
    from tests.common.shards import cfg, write_set

    shards = write_set(tmp_path / "set", [4], num_classes=2)  # 40 x 32 JPEGs
    loader = build_loader(shards, cfg(batch_size=2, decode="gpu", max_pixels=1000), World.single(), train=False)
    with pytest.raises(DataError, match=r"'s00000\.jpg'.*40 x 32 = 1280 pixels, over max_pixels = 1000"):
        list(loader)



# --------------------------------------------------------------------------- 10. a small JPEG of thousands of scans
def _scan_bomb(side: int = 256, copies: int = 1000) -> bytes:
    """A progressive JPEG whose last scan is repeated ``copies`` times: every decoder reads each repeat as another
    pass over the whole image (a 52 KB file of 2,010 scans at 2000 x 2000 took 4.5 s in Pillow)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), (120, 130, 140)).save(buf, "JPEG", quality=90, progressive=True)
    data = buf.getvalue()
    last = data.rindex(b"\xff\xda")  # a flat image's last scan holds no FF byte: it runs to the end marker
    assert data.endswith(b"\xff\xd9") and data.count(b"\xff", last + 2, len(data) - 2) == 0
    return data[:-2] + data[last:-2] * copies + b"\xff\xd9"


def test_the_scan_limit_reads_the_frame_not_the_bytes():
    """Only a progressive frame's scans are counted; a baseline JPEG, a normal progressive one, a JPEG that ends in
    its header, runs of fill bytes and non-JPEG data pass to the decoder (which says what it thinks of them)."""
    from PIL import Image

    from gpufeed.shardset.images import MAX_JPEG_SCANS, jpeg_problem

    def jpeg(**kw) -> bytes:
        buf = io.BytesIO()
        Image.new("RGB", (64, 48), (10, 200, 30)).save(buf, "JPEG", **kw)
        return buf.getvalue()

    plain, progressive = jpeg(), jpeg(progressive=True)
    assert 5 <= progressive.count(b"\xff\xda") <= 20
    assert jpeg_problem(plain) is None and jpeg_problem(progressive) is None
    assert jpeg_problem(_scan_bomb(64, MAX_JPEG_SCANS)) is not None  # 10 + 256 scans
    assert jpeg_problem(_scan_bomb(64, MAX_JPEG_SCANS - 10)) is None
    assert jpeg_problem(plain[:-2] + plain[plain.rindex(b"\xff\xda"):-2] * 300 + b"\xff\xd9") is None  # baseline
    assert jpeg_problem(progressive[:30]) is None
    assert jpeg_problem(b"\x89PNG\r\n\x1a\n" + b"\xff\xda" * 1000) is None
    # what libjpeg reads past, the walk reads past too: junk bytes between segments, fill bytes, a header of many
    # segments (too long to walk: every scan marker is counted)
    bomb = _scan_bomb(64, MAX_JPEG_SCANS)
    assert jpeg_problem(bomb[:2] + b"\0junk" + bomb[2:]) is not None
    assert jpeg_problem(bomb[:2] + b"\xff" * 10_000 + bomb[2:]) is not None
    assert jpeg_problem(bomb[:2] + b"\xff\xfe\x00\x02" * 100 + bomb[2:]) is not None  # 100 empty comments
    # a header Pillow would parse for seconds in Python is refused outright: 5,000 segments, 24 MB of fill bytes,
    # 100 KB of junk between segments
    for long_header in (b"\xff\xfe\x00\x02" * 5000, b"\xff" * 24_000_000, b"\xff\xfe\x00\x02" + b"\0" * 100_000):
        assert "JPEG" in jpeg_problem(plain[:2] + long_header + plain[2:])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("decode", ["pil", "pil-draft", "simplejpeg", "roi", "gpu"])
def test_loader_refuses_a_jpeg_of_thousands_of_scans_before_decoding(tmp_path, decode):
    from gpufeed.core.errors import DataError
    from gpufeed.core.world import World
    from gpufeed.loader import build_loader
    from gpufeed.loader.decode import roi_available
    from tests.common.shards import cfg, encode, smooth_image, write_set

    if decode in ("simplejpeg", "roi"):
        pytest.importorskip("simplejpeg")
    if decode == "roi" and not roi_available():
        pytest.skip("decode = 'roi' needs nvImageCodec")
    bomb = _scan_bomb()
    assert len(bomb) < 60_000

    def make(n):
        return ("jpg", bomb) if n == 1 else ("jpg", encode(smooth_image(16, 12, n)))

    shards = write_set(tmp_path / "scans", [4], num_classes=2, make=make)
    loader = build_loader(shards, cfg(batch_size=2, decode=decode), World.single(), train=True)
    with pytest.raises(DataError, match=r"'s00001\.jpg' in shard .*train-000000\.tar.*progressive JPEG of 1010 "
                                        r"scans, more than the 256"):
        list(loader)
    loader = build_loader(shards, cfg(batch_size=2, decode=decode, on_error="skip"), World.single(), train=True)
    assert len(list(loader)) == 2 and loader.num_skipped == 1


def test_verify_and_shard_refuse_a_jpeg_of_thousands_of_scans(tmp_path, image_folder):
    from gpufeed.verify import verify_shards
    from tests.common.cli import invoke_json
    from tests.test_verify import foreign_set, jpeg_bytes

    bomb = _scan_bomb()
    root = foreign_set(tmp_path, [[("ok.jpg", jpeg_bytes(tmp_path)), ("ok.cls", b"0"), ("scans.jpg", bomb),
                                   ("scans.cls", b"1")]], gzip=False)
    rep = verify_shards(root, workers=1)
    assert not rep.ok and rep.num_decoded == 1
    (problem,) = rep.problems
    assert problem.member == "scans.jpg" and "progressive JPEG of 1010 scans, more than the 256" in problem.reason
    src = image_folder(classes=2, per_class=2)
    (src / "class_0" / "scans.jpg").write_bytes(bomb)
    for check in ("header", "full"):
        out = invoke_json(["shard", src, tmp_path / f"out-{check}", "--workers", "1", "--quiet", "--check", check])
        assert out["num_rejected"] == 1 and out["rejected"][0]["path"] == "class_0/scans.jpg"
        assert out["rejected"][0]["reason"].startswith("a progressive JPEG of 1010 scans, more than the 256")


# --------------------------------------------------------------------------- 11. JPEG frames no decoder should get
def _seg(marker: int, payload: bytes) -> bytes:
    import struct

    return bytes([0xFF, marker]) + struct.pack(">H", len(payload) + 2) + payload


def _frame(sof: int, w: int, h: int, scans: list[list[int]], components: int = 3) -> bytes:
    """A JPEG header (quantisation table, frame ``sof``, the ``scans``, each naming its components, with no entropy
    data): what the header checks read. Such a sequential file with a first scan of one component makes libjpeg
    buffer the image and pass over it again for every further scan (4.3 KB, 300 scans of 9000 x 9000, arithmetic
    coded: 30 s in Pillow and in simplejpeg)."""
    import struct

    comps = b"".join(bytes([i + 1, 0x11, 0]) for i in range(components))
    head = _seg(0xDB, b"\x00" + b"\x01" * 64) + _seg(sof, b"\x08" + struct.pack(">HH", h, w) + bytes([components])
                                                    + comps)
    body = b"".join(_seg(0xDA, bytes([len(ids)]) + b"".join(bytes([c, 0]) for c in ids) + bytes([0, 63, 0]))
                    for ids in scans)
    return b"\xff\xd8" + head + body + b"\xff\xd9"


def test_jpeg_frames_are_judged_by_type_and_scans():
    from gpufeed.shardset.images import jpeg_problem

    one_scan, three = [[1, 2, 3]], [[1], [2], [3]]
    assert jpeg_problem(_frame(0xC0, 64, 64, one_scan)) is None  # baseline: libjpeg refuses a second scan itself
    assert jpeg_problem(_frame(0xC0, 64, 64, one_scan * 50)) is None
    assert jpeg_problem(_frame(0xC0, 64, 64, three)) is None  # one scan per component: legal, and no more work
    for sof in (0xC0, 0xC1, 0xC9):  # baseline, extended, arithmetic sequential
        assert "sequential JPEG of 301 scans for its 3 components" in jpeg_problem(_frame(sof, 9000, 9000,
                                                                                          [[1]] + [[1, 2, 3]] * 300))
    for sof in (0xC3, 0xC7, 0xCB, 0xCF):
        assert "lossless JPEG" in jpeg_problem(_frame(sof, 64, 64, one_scan))
    two = _frame(0xC0, 16, 16, one_scan)
    two = two[:-2 - 14] + _seg(0xC0, two[two.index(b"\xff\xc0") + 4: two.index(b"\xff\xc0") + 19]) + two[-2 - 14:]
    assert "2 frame headers" in jpeg_problem(two)
    # progressive: at most 256 scans, and scans x pixels bounded (2^31: 24 scans at 89.5 megapixels)
    assert jpeg_problem(_frame(0xC2, 9459, 9459, one_scan * 20)) is None
    assert "scans x pixels" in jpeg_problem(_frame(0xC2, 9459, 9459, one_scan * 30))
    assert "scans x pixels" in jpeg_problem(_frame(0xCA, 9459, 9459, one_scan * 256))


_LOSSLESS_CHILD = r"""
import io, struct, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from gpufeed.loader import decode as dec

def seg(m, p):
    return bytes([0xFF, m]) + struct.pack(">H", len(p) + 2) + p

def lossless(rgb):  # a valid 8-bit lossless JPEG (SOF3, predictor 1, one Huffman table: categories at length 5)
    h, w, nc = rgb.shape
    a = rgb.astype(np.int32)
    pred = np.empty_like(a); pred[:, 1:] = a[:, :-1]; pred[1:, 0] = a[:-1, 0]; pred[0, 0] = 128
    diff = (a - pred) % 65536; diff = np.where(diff >= 32768, diff - 65536, diff)
    dht = seg(0xC4, b"\x00" + bytes([0, 0, 0, 0, 17] + [0] * 11) + bytes(range(17)))
    sof = seg(0xC3, b"\x08" + struct.pack(">HH", h, w) + bytes([nc]) + b"".join(bytes([i + 1, 0x11, 0]) for i in range(nc)))
    sos = seg(0xDA, bytes([nc]) + b"".join(bytes([i + 1, 0]) for i in range(nc)) + bytes([1, 0, 0]))
    bits = []
    for d in diff.reshape(-1).tolist():
        cat = abs(d).bit_length(); bits.append(format(cat, "05b"))
        if cat and cat < 16:
            bits.append(format(d if d > 0 else d + (1 << cat) - 1, f"0{cat}b"))
    s = "".join(bits); s += "1" * (-len(s) % 8)
    return b"\xff\xd8" + dht + sof + sos + int(s, 2).to_bytes(len(s) // 8, "big").replace(b"\xff", b"\xff\x00") + b"\xff\xd9"

data = lossless(np.random.default_rng(0).integers(0, 256, (1000, 1200, 3), dtype=np.uint8))
out = np.zeros((224, 224, 3), np.uint8)
for method in sys.argv[2:]:
    try:  # a crop a 1/4-size decode can serve: simplejpeg sized its buffer for 1/4 and libjpeg-turbo wrote full rows
        dec.decode_into(data, "jpg", method, lambda w, h: dec.Crop((0.0, 0.0, 1200.0, 1000.0)), 224, out)
        print(method, "decoded")
    except Exception as exc:
        print(method, type(exc).__name__, exc)
"""


def test_a_lossless_jpeg_is_refused_before_a_decoder_overruns_its_buffer(tmp_path):
    """Run in a child process: before the check, the reduced-size decode of this valid lossless JPEG overran
    simplejpeg's buffer (SIGSEGV, or "double free or corruption")."""
    methods = ["pil", "pil-draft", "simplejpeg"] + (["roi"] if _roi() else [])
    res = subprocess.run([sys.executable, "-c", _LOSSLESS_CHILD, str(ROOT / "src"), *methods], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, (res.returncode, res.stderr[-500:])
    lines = res.stdout.splitlines()
    assert len(lines) == len(methods) and all("ImageRefused a lossless JPEG (frame type C3)" in ln for ln in lines)


def _roi() -> bool:
    from gpufeed.loader.decode import roi_available

    return roi_available()


def test_a_441_jpeg_decodes_on_the_simplejpeg_paths():
    """simplejpeg's header reader has no name for TurboJPEG's 4:4:1 sampling (KeyError 6): such a JPEG takes the
    PIL path instead of being lost with "KeyError: 6"."""
    import numpy as np

    from gpufeed.loader import decode as dec

    sj = pytest.importorskip("simplejpeg")
    colour = np.full((64, 64, 3), (200, 60, 30), np.uint8)
    data = bytearray(sj.encode_jpeg(colour, colorsubsampling="411", quality=90))
    sof = data.index(b"\xff\xc0")
    for k in range(data[sof + 9]):  # 4x1 luma -> 1x4: a flat image's blocks are alike, so the data stays valid
        hv = data[sof + 11 + 3 * k]
        data[sof + 11 + 3 * k] = ((hv & 0xF) << 4) | (hv >> 4)
    data = bytes(data)
    with pytest.raises(KeyError):
        sj.decode_jpeg_header(data)
    for method in ["simplejpeg"] + (["roi"] if _roi() else []):
        out = np.zeros((32, 32, 3), np.uint8)
        dec.decode_into(data, "jpg", method, lambda w, h: dec.Crop((0.0, 0.0, 40.0, 40.0)), 32, out)
        assert np.abs(out.astype(int) - colour[:32, :32]).max() <= 2


def test_the_roi_decode_refuses_a_truncated_jpeg_with_a_thumbnail():
    """An Exif thumbnail's end marker sits in the header: a file cut short in its scan, with fewer than 4 KiB of
    scan data left, still has an FF D9 in its last 4 KiB. It must follow the first scan."""
    from gpufeed.loader import decode as dec

    if not _roi():
        pytest.skip("decode = 'roi' needs nvImageCodec")
    import numpy as np
    from PIL import Image

    thumb = io.BytesIO()
    Image.new("RGB", (32, 32), (9, 9, 9)).save(thumb, "JPEG")
    exif = b"Exif\0\0" + thumb.getvalue()  # not a parseable TIFF: Pillow ignores it, libjpeg skips APP1
    full = io.BytesIO()
    rng = np.random.default_rng(3)
    Image.fromarray(rng.integers(0, 255, (640, 640, 3), dtype=np.uint8)).save(full, "JPEG", quality=90)
    data = full.getvalue()
    data = data[:2] + _seg(0xE1, exif) + data[2:]
    cut = data[: data.index(b"\xff\xda") + 2000]
    assert cut.rfind(b"\xff\xd9", max(0, len(cut) - dec.EOI_TAIL)) >= 0 and not dec.ends_like_jpeg(cut)
    top = dec.Crop((0.0, 0.0, 300.0, 16.0))
    with pytest.raises(ValueError):
        dec.decode_into(cut, "jpg", "roi", lambda *_: top, 32, np.zeros((32, 32, 3), np.uint8))


def test_a_16_bit_grey_png_reads_as_gpufeed_shard_writes_it():
    """Pillow's convert("RGB") clips a 16-bit image (a ramp turns white); the loader scales it to 8 bits as
    `gpufeed shard` does."""
    import numpy as np
    from PIL import Image

    from gpufeed.loader import decode as dec

    ramp = (np.arange(64 * 64, dtype=np.uint32).reshape(64, 64) * 16).astype(np.uint16)  # 0 .. 65520
    buf = io.BytesIO()
    Image.fromarray(ramp).save(buf, "PNG")
    assert Image.open(io.BytesIO(buf.getvalue())).mode.startswith("I")
    out = np.zeros((64, 64, 3), np.uint8)
    dec.decode_into(buf.getvalue(), "png", "pil", lambda w, h: dec.eval_crop(w, h, 64, crop_ratio=1.0), 64, out)
    want = (ramp >> 8).astype(np.int64)
    assert np.abs(out[..., 0].astype(np.int64) - want).mean() < 1.0 and (out == 255).mean() < 0.05


def test_a_png_of_millions_of_chunks_is_refused_before_pillow_parses_them():
    import struct
    import zlib

    from gpufeed.shardset.images import MAX_PNG_CHUNKS, ImageRefused, open_image, png_problem

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = chunk(b"IHDR", struct.pack(">IIBBBBB", 4, 4, 8, 0, 0, 0, 0))
    idat = chunk(b"IDAT", zlib.compress(b"\0\0\0\0\0" * 4))
    ok = b"\x89PNG\r\n\x1a\n" + ihdr + idat + chunk(b"IEND", b"")
    flood = ok[:-12 - len(idat)] + chunk(b"zzZz", b"") * (MAX_PNG_CHUNKS + 1) + idat + chunk(b"IEND", b"")
    assert png_problem(ok) is None and open_image(ok).size == (4, 4)
    assert "more than 100000 chunks" in png_problem(flood)
    with pytest.raises(ImageRefused):
        open_image(flood)


def test_an_image_the_device_decoder_refuses_is_one_corrupt_sample(tmp_path):
    """decode = "gpu": a JPEG whose header passes every check in the worker but whose Huffman table the decoder
    refuses used to fail the whole batch with the decoder's RuntimeError (on the CPU device here: TorchCodec's
    libjpeg-turbo; nvJPEG on CUDA). Now it is a corrupt sample named in one sentence, or, with skip, counted, its
    row and label repeating another of the batch."""
    pytest.importorskip("torchcodec")
    import torch

    from gpufeed.core.errors import DataError
    from gpufeed.core.world import World
    from gpufeed.loader import build_loader
    from tests.common.shards import cfg, encode, smooth_image, write_set

    good = encode(smooth_image(64, 48, 1))
    bad = bytearray(good)
    dht = bad.index(b"\xff\xc4")
    bad[dht + 5: dht + 21] = bytes([255] * 16)  # 16 x 255 codes: "Bogus Huffman table definition"
    shards = write_set(tmp_path / "set", [4], num_classes=4,
                       make=lambda n: ("jpg", bytes(bad)) if n == 1 else ("jpg", encode(smooth_image(64, 48, n))))

    def run(policy: str):
        loader = build_loader(shards, cfg(batch_size=2, decode="gpu", on_error=policy), World.single(), train=False)
        return loader, [loader.to_device(b, "cpu") for b in loader]

    with pytest.raises(DataError, match=r"corrupt sample 's00001\.jpg' in shard .*train-000000\.tar: the device "
                                        r"decode failed: RuntimeError: .*Huffman"):
        run("raise")
    loader, batches = run("skip")
    assert len(batches) == 2 and loader.num_skipped == 1 and loader.num_repeated == 1
    images, labels = batches[0]  # rows s00000, s00001: the refused row repeats row 0
    assert torch.equal(images[1], images[0]) and labels[1] == labels[0]


def _png_bomb(side: int = 13_000) -> bytes:
    """A real, valid 1-bit grey PNG of side x side pixels (all black) that compresses to ~20 KB."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\0" * (1 + (side + 7) // 8)  # filter byte + packed bits
    ihdr = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    idat = zlib.compress(row * side, 9)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def test_verify_refuses_a_png_decompression_bomb_before_decoding_it(tmp_path):
    from PIL import Image

    from gpufeed.verify import render_verify, verify_shards
    from tests.test_verify import foreign_set, jpeg_bytes

    bomb = _png_bomb()
    with pytest.warns(Image.DecompressionBombWarning):  # Pillow itself calls it a bomb (and would decode it)
        assert len(bomb) < 40_000 and Image.open(io.BytesIO(bomb)).size == (13_000, 13_000)
    root = foreign_set(tmp_path, [[("ok.jpg", jpeg_bytes(tmp_path)), ("ok.cls", b"0"), ("big.png", bomb),
                                   ("big.cls", b"1")]], gzip=False)
    rep = verify_shards(root, workers=1)
    assert not rep.ok and rep.num_decoded == 1
    (problem,) = rep.problems
    assert problem.member == "big.png"
    assert problem.reason == "decompression bomb: 13000x13000 = 169000000 pixels > max_pixels 89478485"
    assert "part-0000.tar member big.png: decompression bomb" in render_verify(rep)


def test_verify_max_pixels_option_applies_to_small_images_too(tmp_path):
    from tests.common.cli import invoke_json
    from tests.test_verify import foreign_set, jpeg_bytes

    root = foreign_set(tmp_path, [[("a.jpg", jpeg_bytes(tmp_path)), ("a.cls", b"0")]], gzip=False)
    assert invoke_json(["verify", root, "--workers", "1", "--no-decode"])["ok"] is True
    res = invoke_json(["verify", root, "--workers", "1", "--no-decode", "--max-pixels", "63"], expect=1)
    assert [p["reason"] for p in res["problems"]] == ["decompression bomb: 8x8 = 64 pixels > max_pixels 63"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("gz", [False, True])
def test_a_member_declaring_more_data_than_the_file_holds_is_refused_not_waited_on(tmp_path, gz):
    """A header whose size field says 2**80 bytes, then only end blocks: tarfile (index, verify, the gzip path)
    would seek over the declared size block by block, forever. Every reader refuses it in one sentence."""
    import gzip

    from gpufeed.config import LoaderConfig
    from gpufeed.core.errors import DataError
    from gpufeed.loader import build_loader
    from gpufeed.core.world import World
    from tests.common.cli import invoke
    from tests.common.shards import encode, smooth_image

    jpg = encode(smooth_image(16, 12, 0))
    good = b"".join(_loader_tar_member(f"s{i:05d}.{ext}", data) for i in (0, 1)
                    for ext, data in (("jpg", jpg), ("cls", b"1")))
    huge = b"\x80" + (2**80).to_bytes(11, "big")  # GNU base-256 size field
    raw = good + _loader_tar_header("s00002.txt", huge) + bytes(1024)
    d = tmp_path / "set"
    d.mkdir()
    name = "a.tar.gz" if gz else "a.tar"
    (d / name).write_bytes(gzip.compress(raw, mtime=0) if gz else raw)
    res = invoke(["index", d], expect=2)
    assert "the tar ends" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    import json

    from gpufeed.shardset.manifest import FORMAT_NAME

    size = (d / name).stat().st_size
    (d / "manifest.json").write_text(json.dumps({
        "format": FORMAT_NAME, "format_version": 1, "prefix": "a", "classes": ["0", "1"], "num_samples": 2,
        "shards": [{"name": name, "num_samples": 2, "bytes": size, "sha256": None}],
        "compression": "gzip" if gz else None}))
    res = invoke(["verify", d], expect=1)
    assert "the tar ends" in res.stdout or "runs past the end" in res.stdout
    with pytest.raises(DataError, match="malformed"):
        for _ in build_loader(d, LoaderConfig(batch_size=1, num_workers=0, image_size=16, decode="pil"),
                              World.single(), train=False):
            pass


@pytest.mark.parametrize("damage", ["trailing garbage", "bad crc", "cut trailer"])
def test_loader_checks_a_gzip_shard_to_its_end_as_index_and_verify_do(tmp_path, damage):
    """The loader stops reading a tar at its end blocks; a gzip shard's CRC, length and anything after the stream
    are checked only when it reads on to the end of the file, as index and verify do."""
    import gzip
    import io
    import json

    from gpufeed.config import LoaderConfig
    from gpufeed.core.errors import DataError
    from gpufeed.loader import build_loader
    from gpufeed.shardset.manifest import FORMAT_NAME
    from gpufeed.core.world import World
    from tests.common.shards import encode, smooth_image, write_tar

    jpg = encode(smooth_image(16, 12, 0))
    buf = io.BytesIO()
    write_tar(buf, [(f"s{i}.{e}", d) for i in range(4) for e, d in (("jpg", jpg), ("cls", b"1"))])
    good = gzip.compress(buf.getvalue(), mtime=0)
    blob = {"trailing garbage": good + b"JUNKJUNK", "bad crc": good[:-8] + bytes([good[-8] ^ 1]) + good[-7:],
            "cut trailer": good[:-4]}[damage]
    (tmp_path / "a.tar.gz").write_bytes(blob)
    (tmp_path / "manifest.json").write_text(json.dumps({
        "format": FORMAT_NAME, "format_version": 1, "prefix": "a", "classes": ["0", "1"], "num_samples": 4,
        "shards": [{"name": "a.tar.gz", "num_samples": 4, "bytes": len(blob), "sha256": None}],
        "compression": "gzip"}))
    cfg = LoaderConfig(batch_size=1, num_workers=0, image_size=16, decode="pil")
    with pytest.raises(DataError, match="a.tar.gz is malformed"):
        for _ in build_loader(tmp_path, cfg, World.single(), train=False):
            pass
