"""Round 4 of the threat model's attacks (issue 16, the second attacker's findings F1, F5, F7, F8, F9, F11, F12):
each test carries out one attack that worked against main before its fix (docs/threat-model.md names the rule)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.common import invoke, write_image
from tests.test_attacks_round3 import EPS, fake_gs  # noqa: F401  (a fixture)


# ------------------------------------------------------------ F1: the ImageFolder baseline runs Ghostscript
def test_the_imagefolder_baseline_opens_images_through_the_allow_list(tmp_path: Path, fake_gs: Path) -> None:
    """``tune --baseline-imagefolder`` measures torchvision's ImageFolder on SRC; its default loader lets Pillow pick
    the EPS plugin for a PostScript file named ``.jpg``, whose load() runs ``gs``. The baseline's loader is the
    allow-list's: the trial fails on such a folder, and gs never runs; a real JPEG still loads as RGB."""
    from gpufeed.config import LoaderConfig
    from gpufeed.tune.trials import imagefolder_loader, measure_imagefolder

    src = tmp_path / "src"
    for k in range(4):
        write_image(src / "a" / f"{k}.jpg")
        (src / "b" / f"{k}.jpg").parent.mkdir(parents=True, exist_ok=True)
        (src / "b" / f"{k}.jpg").write_bytes(EPS)
    rec = measure_imagefolder(src, LoaderConfig(batch_size=8, num_workers=0, image_size=8), warmup_batches=1,
                              window_batches=1, repeats=1)
    assert rec.error and not fake_gs.exists()
    img = imagefolder_loader(str(src / "a" / "0.jpg"))
    assert img.mode == "RGB" and img.size == (8, 8)


# ------------------------------------------------ F5: a URL after a digit, '-', '.' or '+' is neither refused nor hidden
@pytest.mark.parametrize("location", ["1https://alice:SECRETPW@host/set", "-https://alice:SECRETPW@host/set",
                                      "9ftp://alice:SECRETPW@host/set", ".s3://alice:SECRETPW@bucket/set",
                                      "x/https://alice:SECRETPW@host/set"])
def test_a_url_after_other_text_is_refused_with_its_password_hidden(location: str) -> None:
    """A scheme starts with a letter, so in ``1https://u:pw@h`` the scheme is ``https``: redact() hides its password
    (the old pattern wanted no scheme character before the scheme, so nothing was found), and a typed location
    holding it is refused (exit 2), not made into a path."""
    r = invoke(["verify", "--json", "--", location], expect=2)
    out = r.stdout + r.stderr
    assert "SECRETPW" not in out and "alice:***@" in out
    assert "neither a URL gpufeed reads" in json.loads(r.stdout)["error"]


def test_redact_finds_a_scheme_wherever_it_starts() -> None:
    from gpufeed.core.redact import redact
    from gpufeed.shardset.source import check_location

    assert (redact("failed.https://u:PW@h/x 3s3://AKIA:SECRET@b/k +ftp:/u:PW@h/x (1http://tok@h)")
            == "failed.https://u:***@h/x 3s3://AKIA:***@b/k +ftp:/u:***@h/x (1http://***@h)")
    assert redact("12:/x@y and C:/a@b/c") == "12:/x@y and C:/***@b/c"  # no letter: no scheme
    long_word = "a1" * 200_000 + ":/"  # one run, matched once: linear
    assert redact(long_word) == long_word
    for ok in ("https://u:pw@h/set", "/data/set", "pipe:curl -s https://u:pw@h/x-{0..1}.tar", "S3://b/k"):
        check_location(ok)


# ---------------------------------------- F7, F8, F11: a forged validation batch of a static split is trusted
def _batch_folder(root: Path) -> list[str]:
    """Two JPEGs (stored as they are), a BMP (transcoded to PNG: the batch's cache) and a file that is no image."""
    write_image(root / "a" / "0.jpg", size=(16, 12))
    write_image(root / "a" / "1.bmp", size=(40, 40), fmt="BMP")
    (root / "a" / "2.jpg").write_bytes(b"junk")
    write_image(root / "a" / "3.jpg", size=(12, 16))
    return [str(root / "a" / n) for n in ("0.jpg", "1.bmp", "2.jpg", "3.jpg")]


def _forge(path: Path, **edits) -> None:
    """Rewrite a saved batch file: ``column=(index, value)`` sets one value; ``reasons=`` replaces the reasons."""
    import numpy as np

    from gpufeed.shard.validate import COLUMNS

    line, _, rest = path.read_bytes().partition(b"\n")
    head = json.loads(line)
    nf = head["n_files"]
    parts, pos = [rest[:nf]], nf
    for name, size in head["columns"]:
        col = np.frombuffer(rest[pos:pos + size], dtype=COLUMNS[name][0]).copy()
        if name in edits:
            col[edits[name][0]] = edits[name][1]
        parts.append(col.tobytes())
        pos += size
    head["reasons"] = edits.get("reasons", head["reasons"])
    path.write_bytes(json.dumps(head).encode() + b"\n" + b"".join(parts))


@pytest.mark.parametrize("edits", [
    {"enc_cache": (0, 7), "enc_len": (0, 100)},  # a pass-through made to read another file's transcoded bytes
    {"action": (0, 255)}, {"ext": (0, 255)}, {"enc_ext": (1, 9)},
    {"width": (0, -5)}, {"height": (0, 2 ** 31 - 1)}, {"width": (2, 0)},
    {"enc_off": (1, -100)}, {"enc_off": (1, 4)}, {"enc_len": (1, 1 << 40)}, {"enc_len": (1, 1)},
    {"id_size": (0, 0)}, {"id_dev": (0, 7)}, {"action": (1, 0)},
    {"reasons": {"2": "FAKE\nsecond line"}}, {"reasons": {"2": "\x1b[31mred"}}, {"reasons": {"2": "x" * 600}},
    {"reasons": {"02": "not an image"}},
])
def test_every_value_of_a_batch_read_from_dest_is_checked(tmp_path: Path, edits: dict) -> None:
    """A split node reads the batches other nodes validated from DEST's state folder, which anyone who can write
    DEST can forge. Each forged value (a cache offset, an action or format code, a size, a reason of two lines) makes
    the batch one that does not check out: it is validated again here, never used."""
    from gpufeed.config import ShardConfig
    from gpufeed.shard.split import BatchStore, NodeSplit, val_name
    from gpufeed.shard.validate import CheckOptions, _validate_chunk, cache_name

    opts = CheckOptions.of(ShardConfig())
    state = tmp_path / "state"
    state.mkdir()
    batch = _validate_chunk(_batch_folder(tmp_path / "src"), opts, str(state / cache_name(0)))
    assert list(batch["ok"]) == [1, 1, 0, 1] and (state / cache_name(0)).exists()
    store = BatchStore(str(state), NodeSplit(2, 1), opts)
    store.save(0, batch)
    assert store.load(0, 4) is not None
    _forge(state / val_name(0), **edits)
    assert store.load(0, 4) is None


def test_a_batch_with_an_honest_multi_line_reason_is_saved_as_one_line(tmp_path: Path) -> None:
    from gpufeed.shard.split import BatchStore, NodeSplit
    from gpufeed.shard.validate import _Checked, batch_columns

    batch = batch_columns([_Checked(False, "decode failed (OSError: a\nb\x1b[0m)", None, 0, 0, 1)])
    store = BatchStore(str(tmp_path), NodeSplit(2, 0))
    assert store.save(0, batch)["reasons"] == {0: "decode failed (OSError: a b [0m)"}
    assert store.load(0, 1)["reasons"] == {0: "decode failed (OSError: a b [0m)"}


def test_cache_bytes_that_do_not_hash_to_the_validated_digest_never_reach_a_shard(tmp_path: Path) -> None:
    """The writer hashes the transcoded bytes it reads back from a cache file and compares them with the sha256
    validation recorded (which also goes into the sample's .json): another offset is a RunError, not a sample
    silently holding another image."""
    import hashlib

    from gpufeed.core.errors import RunError
    from gpufeed.shard.write import Item, write_range

    cache = tmp_path / "enc-000000.bin"
    cache.write_bytes(b"A" * 100 + b"B" * 100)
    tmp = tmp_path / ".a.tar.tmp"
    tmp.write_bytes(bytes(4096))
    claimed = hashlib.sha256(b"A" * 100).hexdigest()
    good = Item(0, "k", "png", 100, b"0", b"{}", "", "c/k.bmp", None, str(cache), 0, claimed)
    write_range(str(tmp), [good])
    with pytest.raises(RunError, match=r"does not hold the bytes validated for c/k\.bmp"):
        write_range(str(tmp), [good._replace(coff=100)])


def test_a_forged_batch_in_dest_makes_no_corrupt_sample(tmp_path: Path) -> None:
    """F7's attack end to end: node 1 is given a batch in which a pass-through sample points at the transcode cache;
    both nodes succeed and the set verifies, because the forged batch was validated again."""
    import numpy as np

    from gpufeed.shard.validate import cache_name
    from gpufeed.shard.split import val_name

    src = tmp_path / "src"
    for c in range(2):
        for i in range(4):
            write_image(src / f"c{c}" / f"{i}.jpg", size=(16, 16), color=(c * 90, i * 40, 9))
    write_image(src / "c0" / "x.bmp", size=(40, 40), fmt="BMP")
    opts = ["--shard-samples", "4", "--num-nodes", "2", "--workers", "1"]
    invoke(["shard", src, tmp_path / "d0", *opts, "--node-rank", "0"])
    state0, state = tmp_path / "d0" / ".gpufeed", tmp_path / "d" / ".gpufeed"
    state.mkdir(parents=True)
    (state / cache_name(0)).write_bytes((state0 / cache_name(0)).read_bytes())
    (state / val_name(0)).write_bytes((state0 / val_name(0)).read_bytes())
    line, _, rest = (state / val_name(0)).read_bytes().partition(b"\n")
    head = json.loads(line)
    pos = head["n_files"] + sum(s for name, s in head["columns"][:head["columns"].index(
        next(c for c in head["columns"] if c[0] == "enc_cache"))])
    copy = int(np.argmax(np.frombuffer(rest[pos:pos + 8 * head["n"]], "<i8") < 0))
    _forge(state / val_name(0), enc_cache=(copy, 0), enc_len=(copy, (state / cache_name(0)).stat().st_size))
    invoke(["shard", src, tmp_path / "d", *opts, "--node-rank", "1"])
    invoke(["shard", src, tmp_path / "d", *opts, "--node-rank", "0"])
    invoke(["verify", tmp_path / "d"])


# -------------------------------------------- F12: no job-level bound on a stalled server; a trickle said "byte 0"


def _range_reply(size: int, start: int = 0) -> bytes:
    return (f"HTTP/1.1 206 Partial Content\r\nContent-Length: {size - start}\r\nContent-Range: bytes "
            f"{start}-{size - 1}/{size}\r\n\r\n").encode()


@pytest.mark.timeout(60)
def test_a_trickled_range_keeps_its_bytes_and_says_where_it_ended(raw_server, monkeypatch) -> None:
    """A server sending a few bytes now and then: each try times out, and the bytes that came count (the next try
    asks from there), so the error says the byte the stream really ended at, not "byte 0"."""
    from gpufeed.shardset import source

    size = 1 << 20
    monkeypatch.setattr(source, "READ_TIMEOUT_S", 0.4)
    monkeypatch.setattr(source, "MIN_BYTES_PER_S", 1 << 40)  # the time bound: READ_TIMEOUT_S alone
    monkeypatch.setattr(source, "RETRY", source.Retry(attempts=10, first_wait_s=0.01, max_wait_s=1.0))

    def trickle(req: bytes):
        return [(_range_reply(size), 0)] + [(b"x" * 10, 0.05)] * 40  # 200 B/s

    server = raw_server(trickle)
    with pytest.raises(source.ReadTimedOut, match=r"stream ended at byte [1-9]\d* of 1048576: 2 tries in a row "
                                                   r"timed out"):
        with source.open_shard(server.url + "/a.tar", size=size) as f:
            f.read(size)
    gets = [r for r in server.requests if r.startswith(b"GET")]
    assert len(gets) == 2


@pytest.mark.timeout(120)
def test_verify_stops_after_shards_in_a_row_time_out(tmp_path: Path, raw_server, monkeypatch) -> None:
    """A stalled server: each shard's read ends after two timed-out tries, and after
    ``MAX_TIMED_OUT_READS_IN_A_ROW`` such shards the job stops (exit 1) naming the bound, instead of waiting the
    same on every other shard of the set."""
    from gpufeed.core.errors import RunError
    from gpufeed.shardset import source
    from gpufeed.verify import verify_shards
    from tests.common import write_tar

    folder = tmp_path / "set"
    folder.mkdir()
    jpeg = write_image(tmp_path / "x.jpg").read_bytes()
    for k in range(8):
        write_tar(folder / f"s-{k:06d}.tar", [(f"k{k}.cls", b"0"), (f"k{k}.jpg", jpeg)])
    (folder / "classes.txt").write_text("a\n")
    invoke(["index", folder])
    manifest = (folder / "manifest.json").read_bytes()
    size = (folder / "s-000000.tar").stat().st_size
    monkeypatch.setattr(source, "READ_TIMEOUT_S", 0.3)
    monkeypatch.setattr(source, "MIN_BYTES_PER_S", 1 << 40)
    monkeypatch.setattr(source, "RETRY", source.Retry(attempts=10, first_wait_s=0.01, max_wait_s=1.0))

    def stall(req: bytes):
        line = req.split(b"\r\n", 1)[0]
        if b"manifest.json" in line:
            head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(manifest)}\r\n\r\n".encode()
            return [(head if line.startswith(b"HEAD") else head + manifest, 0)]
        if line.startswith(b"HEAD"):
            return [(f"HTTP/1.1 200 OK\r\nContent-Length: {size}\r\nAccept-Ranges: bytes\r\n\r\n".encode(), 0)]
        return [(_range_reply(size), 0)] + [(b"", 0.1)] * 20  # headers, then silence

    server = raw_server(stall)
    with pytest.raises(RunError, match=r"verify stopped after 3 shards in a row whose reads timed out \(the job's "
                                       r"bound, MAX_TIMED_OUT_READS_IN_A_ROW; the last: s-000002.tar\); 5 of 8 shards"):
        verify_shards(server.url + "/", workers=1)
    assert sum(r.startswith(b"GET") and b".tar" in r for r in server.requests) == 6


# ------------------------------------------------ F9: --engine ray: Ray's signal handlers, a stack dump, exit 134
def test_a_ray_job_stops_on_sigterm_in_one_sentence_and_puts_the_handlers_back(monkeypatch) -> None:
    """ray.init replaces the driver's SIGTERM handler (``sys.exit(15)`` while it starts) and its core worker adds a
    C++ one that dumps a stack and aborts (exit 134). The driver disables the C++ one, turns Ray's start-up exit into
    Interrupted, and once Ray runs handles SIGTERM/SIGHUP itself: Interrupted (exit 143, one sentence), Ray shut down
    by the pool, the previous handlers put back. Ray itself is not started here (its calls are stubbed)."""
    import os
    import signal

    ray = pytest.importorskip("ray")
    from gpufeed.config import ShardConfig
    from gpufeed.core.errors import Interrupted
    from gpufeed.shard import engine_ray

    calls: list[str] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2})
    monkeypatch.delenv("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", raising=False)
    monkeypatch.delenv("RAY_gcs_rpc_server_reconnect_timeout_s", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    seen: list[tuple] = []

    def init_killed(**kw):  # a SIGTERM while Ray starts: its own handler's sys.exit(15)
        calls.append("init")
        seen.append((os.environ.get("RAY_DISABLE_FAILURE_SIGNAL_HANDLER"),
                     os.environ.get("RAY_gcs_rpc_server_reconnect_timeout_s")))
        raise SystemExit(signal.SIGTERM)

    monkeypatch.setattr(ray, "init", init_killed)
    with pytest.raises(Interrupted, match=r"^shard stopped by SIGTERM; Ray was shut down") as info:
        engine_ray.ray_pool(ShardConfig(workers=2))
    assert info.value.exit_code == 143 and calls == ["init", "shutdown"]
    # set while Ray started; taken out again once it is shut down (a later Ray in this process gets its defaults)
    assert seen == [("1", str(engine_ray.LOCAL_GCS_RECONNECT_S))]
    assert not {"RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "RAY_gcs_rpc_server_reconnect_timeout_s"} & set(os.environ)

    monkeypatch.setattr(ray, "init", lambda **kw: signal.signal(signal.SIGTERM, lambda *a: os._exit(99)))
    before = signal.getsignal(signal.SIGTERM)
    workers, pool = engine_ray.ray_pool(ShardConfig(workers=2))
    try:
        with pytest.raises(Interrupted, match=r"^shard stopped by SIGTERM") as info:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100):  # the handler runs at the next bytecode
                pass
        assert info.value.exit_code == 143
    finally:
        pool.shutdown(cancel_futures=True)
    assert signal.getsignal(signal.SIGTERM) is before and calls[-1] == "shutdown"
    assert "RAY_DISABLE_FAILURE_SIGNAL_HANDLER" not in os.environ
