"""Round 3 of the threat model's attacks (issue 16): each test carries out one attack that worked against main
before its fix (docs/threat-model.md names the rule each one checks)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.common.cli import invoke
from tests.common.shards import write_image, write_tar

EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 16 16\n%%EndComments\nshowpage\n%%EOF\n"


# ------------------------------------------------------------------------- C1: an image member runs Ghostscript
@pytest.fixture
def fake_gs(tmp_path: Path, monkeypatch) -> Path:
    """A ``gs`` first on PATH that answers ``--version`` and otherwise notes that it ran; returns the note's path."""
    bin_dir, ran = tmp_path / "bin", tmp_path / "GS_RAN"
    bin_dir.mkdir()
    (bin_dir / "gs").write_text(f'#!/bin/sh\n[ "$1" = --version ] && {{ echo 10.02.1; exit 0; }}\n'
                                f'echo ran >> {ran}\nexit 1\n')
    (bin_dir / "gs").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return ran


def test_a_postscript_image_never_reaches_ghostscript(tmp_path: Path, fake_gs: Path) -> None:
    """An EPS file named ``.jpg``, as a shard member (verify, the loader's decoders) and as a SRC file (shard): it
    is not an image, and Pillow's EPS plugin, whose load() runs ``gs`` on the attacker's PostScript, never opens it."""
    from PIL import UnidentifiedImageError

    from gpufeed.loader.decode import decode_pil, image_size, is_gpu_decodable

    folder = tmp_path / "set"
    folder.mkdir()
    write_tar(folder / "train-000000.tar", [m for k in range(2) for m in ((f"s{k}.jpg", EPS), (f"s{k}.cls", b"0"))])
    (folder / "classes.txt").write_text("a\n")
    invoke(["index", folder])
    r = invoke(["verify", folder, "--workers", "1"], expect=1)
    assert "not a JPEG, PNG, WEBP image" in r.stdout + r.stderr
    for fn in (image_size, is_gpu_decodable, lambda d: decode_pil(d, None, 8, None)):
        with pytest.raises(UnidentifiedImageError):
            fn(EPS)
    src = tmp_path / "src"
    write_image(src / "a" / "ok.jpg")
    (src / "a" / "evil.jpg").write_bytes(EPS)
    r = invoke(["shard", src, tmp_path / "out", "--workers", "1", "--json"])
    assert [x["path"] for x in json.loads(r.stdout)["rejected"]] == ["a/evil.jpg"]
    assert not fake_gs.exists()


# ------------------------------------------------------- C2: a URL of an unsupported scheme becomes a path, password shown
@pytest.mark.parametrize("args", [
    ["verify", "ftp://alice:SHORTPW@host/set/"],
    ["index", "ftp://alice:SHORTPW@host/set/x-{0..1}.tar", "--out", "OUT"],
    ["io", "sftp://alice:SHORTPW@host/set/"],
    ["stage", "HTTPS+X://alice:SHORTPW@host/set/", "OUT"],
    ["tune", "file://alice:SHORTPW@host/set/"],
    ["train", "--shards", "hdfs://alice:SHORTPW@host/set/", "--steps", "1"],
])
def test_an_unsupported_url_scheme_is_refused_with_its_password_hidden(tmp_path: Path, args: list[str]) -> None:
    """pathlib turns ``ftp://u:pw@h`` into ``ftp:/u:pw@h``, which no longer looks like a URL to redact(): every
    command refuses the scheme before it becomes a path (exit 2, one sentence), the password hidden."""
    r = invoke([a.replace("OUT", str(tmp_path / "out")) for a in args] + ["--json"], expect=2)
    assert "SHORTPW" not in r.stdout + r.stderr
    assert "does not read" in json.loads(r.stdout)["error"]
    assert not (tmp_path / "out").exists()


def test_open_set_refuses_an_unsupported_scheme_and_redact_catches_the_collapsed_form() -> None:
    """The library edge (a config file's ``shards``) refuses it too; redact() hides a ``scheme:/user:pw@`` that a
    path made of a URL still carries, wherever it comes from."""
    from gpufeed.core.errors import DataError
    from gpufeed.core.redact import redact
    from gpufeed.shardset.source import open_set

    with pytest.raises(DataError, match=r"^webdav://bob:\*\*\*@h/s: gpufeed does not read webdav://"):
        open_set("webdav://bob:PW@h/s")
    assert redact("folder ftp:/alice:SHORTPW@host/set is missing") == "folder ftp:/alice:***@host/set is missing"
    assert redact("/data/C:/x and ftp:/host/a@b") == "/data/C:/x and ftp:/host/a@b"


# ------------------------------------------- H1: a manifest's root makes stage copy a private file into DEST
def _rooted_set(tmp_path: Path, shard: Path) -> Path:
    """A set folder whose manifest's absolute ``root`` points at ``shard``'s folder, naming it without a sha256."""
    from tests.common.shards import write_tiny_shards

    folder = write_tiny_shards(tmp_path / "set", [3], image_px=16)
    m = json.loads((folder / "manifest.json").read_text())
    s = dict(m["shards"][0], name=shard.name, bytes=shard.stat().st_size, sha256=None)
    m.update(shards=[s], num_samples=s["num_samples"], total_bytes=s["bytes"], url_pattern=shard.name,
             root=str(shard.parent))
    (folder / "manifest.json").write_text(json.dumps(m))
    return folder


def test_stage_never_copies_a_non_tar_nor_loosens_a_private_files_mode(tmp_path: Path) -> None:
    """An unhashed shard is checked as a tar holding the manifest's samples before it is published (a private
    non-tar is not copied, and nothing of it is printed); a private real shard keeps its 0600 in DEST."""
    from tests.common.shards import write_tiny_shards

    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    secret = private / "notatar.tar"
    secret.write_bytes(os.urandom(12345))
    secret.chmod(0o600)
    r = invoke(["stage", _rooted_set(tmp_path / "a", secret), tmp_path / "dest", "--json"], expect=1)
    assert "does not read as a tar" in json.loads(r.stdout)["error"]
    assert not (tmp_path / "dest" / "notatar.tar").exists()
    real = write_tiny_shards(tmp_path / "private2", [3], image_px=16) / "train-000000.tar"
    real.chmod(0o600)
    invoke(["stage", _rooted_set(tmp_path / "b", real), tmp_path / "dest2"])
    assert (tmp_path / "dest2" / "train-000000.tar").stat().st_mode & 0o777 == 0o600


def test_a_header_that_does_not_check_out_is_reported_without_its_bytes(tmp_path: Path) -> None:
    """The name field of a header whose checksum or numbers are wrong is any bytes of the file (a secret behind a
    link, random data): the tar reader's sentence gives the offset and the reason, never those bytes."""
    from gpufeed.shardset.sidecars import tar_members
    from gpufeed.shardset.tar import TarFormatError

    for junk in (b"TOPSECRET-NAME" + b"\x94" * 498, b"TOPSECRET-NAME" + b"\0" * 110 + b"12345678zz" + b"\0" * 378):
        (tmp_path / "x.tar").write_bytes(junk + b"\0" * 1024)
        with pytest.raises(TarFormatError) as e:
            list(tar_members(str(tmp_path / "x.tar")))
        assert "TOPSECRET" not in str(e.value) and "zz" not in str(e.value)


# --------------------------------------------- H2: rendezvous hangs past its bound when the store port answers nothing
@pytest.mark.timeout(60)
def test_a_store_port_that_accepts_and_says_nothing_ends_the_rendezvous_within_its_bound(monkeypatch) -> None:
    """A port that accepts connections and never answers (a silent listener, a wrong service): torch's TCPStore
    client waits on its first handshake with no bound; the rank gives up at the bound, naming rank 0."""
    import socket
    import time

    from gpufeed.core import world
    from gpufeed.core.errors import RunError

    for key in ("TORCHELASTIC_USE_AGENT_STORE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(world, "STORE_GRACE_S", 0.5, raising=False)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # accepted by the kernel, never read or answered
        env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(silent.getsockname()[1]), "GPUFEED_RENDEZVOUS_TIMEOUT_S": "2"}
        t0 = time.monotonic()
        with pytest.raises(RunError, match=r"rank 1 could not reach the store at 127\.0\.0\.1:\d+ within 2 s: rank 0"):
            world.join(world.World(rank=1, world_size=2), env)
        assert time.monotonic() - t0 < 10


# ------------------------------------- H3: img2dataset records read through links out of the set, contents printed
def test_img2dataset_records_linked_from_outside_the_set_are_refused_unread(tmp_path: Path) -> None:
    """``NNNNN.parquet`` and ``NNNNN_stats.json`` are files of the set like any other: a link out of the set is
    refused by name (counted as unreadable), and nothing of the target reaches stdout, stderr or --json."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.test_bounds_round2 import _jpeg

    folder, elsewhere = tmp_path / "set", tmp_path / "elsewhere"
    elsewhere.mkdir()
    folder.mkdir()
    jpg = _jpeg()
    write_tar(folder / "00000.tar",
              [m for k in range(3) for m in ((f"{k:09d}.jpg", jpg), (f"{k:09d}.txt", f"cat{k % 2}".encode()))])
    pq.write_table(pa.table({"url": ["https://corp/x?sig=SIGNATURESECRET"], "status": ["failed_to_download"],
                             "error_message": ["TOPSECRET"]}), elsewhere / "o.parquet")
    (elsewhere / "s.json").write_text('{"count": 7, "successes": 3, "failed_to_download": 4, '
                                      '"failed_to_resize": 0, "note": "STATSECRET"}')
    (folder / "00000.parquet").symlink_to(elsewhere / "o.parquet")
    (folder / "00000_stats.json").symlink_to(elsewhere / "s.json")
    r = invoke(["index", folder, "--label", "txt", "--json"], expect=None)
    out = r.stdout + r.stderr
    assert "SIGNATURESECRET" not in out and "TOPSECRET" not in out
    assert "00000.parquet is a symbolic link that leads out of the set folder" in out
    assert "00000_stats.json is a symbolic link that leads out of the set folder" in out


# ------------------------------- H4: resume on a set indexed again with another class order continues, mislabelled
from tests.test_train_integrity import _trainer, checkpoint_of_forty, two_sets  # noqa: E402,F401 - fixtures


def test_resume_on_the_same_shards_with_another_class_order_is_refused(two_sets, checkpoint_of_forty, tmp_path):
    """The same shards indexed again with the class list reversed (or another label member): every label index
    names another class, so the checkpoint is for another set (refused, or --resume-other-set); a checkpoint
    written before the class list was recorded resumes with a note."""
    import shutil

    import torch

    from gpufeed.core.errors import DataError

    swapped = tmp_path / "swapped"
    shutil.copytree(two_sets[0], swapped)
    m = json.loads((swapped / "manifest.json").read_text())
    m["classes"] = m["classes"][::-1]
    (swapped / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DataError, match=r"another shard set \(the same shards, other classes, another class order"):
        _trainer(swapped, checkpoint_of_forty).load_checkpoint()
    t = _trainer(swapped, checkpoint_of_forty, resume_other_set=True)
    t.load_checkpoint()
    assert t.step_in_epoch == 0
    state = torch.load(checkpoint_of_forty / "last.pt", map_location="cpu", weights_only=True)
    del state["shard_set"]["labels"]
    (tmp_path / "old").mkdir()
    torch.save(state, tmp_path / "old" / "last.pt")
    t = _trainer(swapped, tmp_path / "old")
    t.load_checkpoint()
    assert t.step_in_epoch == 4 and any("records no class list" in n for n in t.notes)


# ------------------------------------------ H5: a false num_samples defeats the class-count bound (memory blowup)
def test_claimed_samples_are_bounded_by_claimed_bytes_and_those_by_the_file(tmp_path: Path) -> None:
    """A manifest adding 1.5 M samples (and as many classes) to a 20-sample shard: refused by the parser, since a
    sample takes at least 512 bytes of tar; claiming 1 TiB for it as well is refused before the run, against the
    file's real size, so the class-count bound never sees the false count (no model head of 1.5 M classes)."""
    from gpufeed.core.errors import DataError
    from gpufeed.shardset.manifest import read_manifest
    from tests.common.shards import write_tiny_shards

    folder = write_tiny_shards(tmp_path / "set", [20])
    m = json.loads((folder / "manifest.json").read_text())
    n = 200_000
    m["classes"] = [f"c{i}" for i in range(n)]
    m["shards"][0]["num_samples"] += n
    m["num_samples"] += n
    (folder / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DataError, match=r"claims 200020 samples in \d+ bytes; a sample takes at least 512"):
        read_manifest(folder)
    m["shards"][0]["bytes"] = 2 ** 40
    (folder / "manifest.json").write_text(json.dumps(m))
    args = ["train", "--shards", folder, "--arch", "resnet18", "--image-size", "32", "--num-workers", "0", "--amp",
            "off", "--device", "cpu", "--batch-size", "2", "--steps", "1", "--threads", "1",
            "--run-dir", tmp_path / "run"]
    r = invoke(args, expect=2)
    assert "is " in r.stderr and "bytes, the manifest says 1099511627776" in r.stderr


# ------------------------------------------------------------- L1: a password holding a line break leaks
def test_a_password_holding_a_line_break_is_hidden_and_such_a_url_refused() -> None:
    """The authority's userinfo runs to its last ``@`` even across a line break; a typed URL holding a control
    character is refused (exit 2) in one line, its password hidden."""
    from gpufeed.core.redact import redact

    assert redact("http://alice:NLpw\nrest@127.0.0.1:1/ok/") == "http://alice:***@127.0.0.1:1/ok/"
    assert redact("at http://h:1\nme@x/") == "at http://h:1\nme@x/"  # a host:port line stays as it is
    r = invoke(["verify", "http://alice:NLpw\nrest@127.0.0.1:1/ok/", "--json"], expect=2)
    assert "NLpw" not in r.stdout + r.stderr and r.stderr.count("\n") == 1
    assert "control character" in json.loads(r.stdout)["error"]


# --------------------------------------------------------------- L3: LOCAL_WORLD_SIZE=0 is accepted
def test_a_node_of_zero_ranks_is_refused_by_the_launch_check() -> None:
    """LOCAL_RANK=0 is not below LOCAL_WORLD_SIZE=0: no node runs zero ranks (exit 2, naming the variable)."""
    from gpufeed.core.errors import ConfigError
    from gpufeed.core.world import check_launch_env

    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE=0"):
        check_launch_env({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "0", "RANK": "0", "WORLD_SIZE": "1"})


# ------------------------------------------------------------------- L4: a class name "" is accepted
def test_an_empty_class_name_in_a_manifest_is_refused(tmp_path: Path) -> None:
    """The threat model says class names are non-empty: the parser refuses ``""`` (train and stage, exit 2)."""
    from tests.common.shards import write_tiny_shards

    folder = write_tiny_shards(tmp_path / "set", [4])
    m = json.loads((folder / "manifest.json").read_text())
    m["classes"][1] = ""
    (folder / "manifest.json").write_text(json.dumps(m))
    r = invoke(["stage", folder, tmp_path / "dest"], expect=2)
    assert "class '' is not a class name (a non-empty string" in r.stderr


# ------------------------------------------------------------- L5: OMP_NUM_THREADS=10^20 reports ok
@pytest.mark.parametrize("value", ["99999999999999999999", "5000", "8," + "9" * 5000])
def test_doctor_fails_an_omp_num_threads_no_machine_can_run(value: str) -> None:
    """A thread count over 4096 (or 64 per usable core) is no usable setting; a 5,000-digit one is refused without
    converting it."""
    from gpufeed import doctor as d
    from gpufeed.config import LoaderConfig

    report = d.run_checks(d.Facts(env={"OMP_NUM_THREADS": value}, usable_cpus=64), LoaderConfig())
    env = next(c for c in report.checks if c.name == "environment")
    assert env.status == "fail" and "not a usable thread count" in env.evidence and not report.ok
    ok = d.run_checks(d.Facts(env={"OMP_NUM_THREADS": "4096"}, usable_cpus=64), LoaderConfig()).checks
    assert next(c for c in ok if c.name == "environment").status == "ok"


# --------------------------------------- L2: an output that cannot be written, found only after the sweep
def test_tune_checks_out_before_the_sweep_and_a_late_write_failure_names_the_file(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    """``--out`` in a folder that takes no file is a usage error before any trial (exit 2); a write that fails
    once the sweep ran is a failed run (exit 1) naming ``x.toml``, never its temporary."""
    import time

    import gpufeed.tune as tune_module
    from tests.common.shards import write_tiny_shards

    shards = write_tiny_shards(tmp_path / "set", [8], image_px=16)
    args = ["tune", shards, "--budget", "3", "--batch-size", "4", "--image-size", "32", "--max-workers", "1",
            "--repeats", "1", "--window", "0.2", "--run-dir", tmp_path / "run"]
    t0 = time.monotonic()
    r = invoke([*args, "--out", "/proc/self/x.toml"], expect=2)
    assert "--out /proc/self/x.toml cannot be written" in r.stderr and time.monotonic() - t0 < 3
    folder = tmp_path / "out"
    folder.mkdir()
    real = tune_module.write_outputs

    def folder_gone(*a, **kw):  # the folder replaced by a file while the sweep ran
        folder.rmdir()
        folder.write_text("")
        return real(*a, **kw)

    monkeypatch.setattr(tune_module, "write_outputs", folder_gone)
    r = invoke([*args, "--out", folder / "x.toml"], expect=1)
    assert f"cannot write {folder / 'x.toml'} (" in r.stderr and ".tmp" not in r.stderr


# ------------------------------------------- M1: io's steps wait on a stalled remote shard with no bound


@pytest.mark.timeout(60)
def test_an_io_step_on_a_stalled_server_ends_by_its_seconds(raw_server, fast_retry, monkeypatch) -> None:
    """A server that sends a range's headers and then nothing: the step's remote reads are bounded by its
    ``--seconds`` (plus ``STEP_GRACE_S``), and the step ends "stopped by seconds" instead of waiting 60 s a try."""
    import time

    from gpufeed.measure import storage_probe as storage

    size = 4 << 20
    monkeypatch.setattr(storage, "STEP_GRACE_S", 0.5)

    def stall(req: bytes):
        if req.startswith(b"HEAD"):
            return [(f"HTTP/1.1 200 OK\r\nContent-Length: {size}\r\n\r\n".encode(), 0)]
        return [(b"HTTP/1.1 206 Partial Content\r\nContent-Length: 1048576\r\nContent-Range: bytes 0-1048575/"
                 + str(size).encode() + b"\r\n\r\n", 0)] + [(b"", 0.1)] * 100  # then silence for 10 s

    server = raw_server(stall)
    files = [(server.url + "/a.tar", size)]
    t0 = time.monotonic()
    nbytes, _, _, stopped_by = storage.run_step(files, "shards", 1, seconds=0.5, limit=size,
                                                opener=storage.remote_opener(files))
    assert stopped_by == "seconds" and nbytes == 0 and time.monotonic() - t0 < 5


@pytest.mark.timeout(60)
def test_a_range_that_times_out_twice_in_a_row_is_not_tried_again(raw_server, monkeypatch) -> None:
    """Each try on a stalled server waits its whole time bound: two in a row end the read (verify and stage read
    shards this way), saying why, however many attempts the retry bound allows."""
    from gpufeed.core.errors import DataError
    from gpufeed.shardset import source

    size = 4 << 20
    monkeypatch.setattr(source, "READ_TIMEOUT_S", 0.3)
    monkeypatch.setattr(source, "RETRY", source.Retry(attempts=10, first_wait_s=0.01, max_wait_s=1.0))

    def stall(req: bytes):
        return [(b"HTTP/1.1 206 Partial Content\r\nContent-Length: 1048576\r\nContent-Range: bytes 0-1048575/"
                 + str(size).encode() + b"\r\n\r\n", 0)] + [(b"", 0.1)] * 30

    server = raw_server(stall)
    with pytest.raises(DataError, match=r"2 tries in a row timed out \(slower than 64 KiB/s, or no answer in 0.3 s"):
        with source.open_shard(server.url + "/a.tar", size=size) as f:
            f.read(1 << 20)
    assert sum(r.startswith(b"GET") for r in server.requests) == 2
