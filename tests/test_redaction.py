"""Passwords in user-typed URLs never reach the terminal, a record or a written file (issue 16): the parsing
:func:`gpufeed.core.redact.redact` over many password shapes, case-insensitive schemes, and the real ``io``, ``tune`` and
``train`` commands against a loopback HTTP server, every file of their run folders walked (only the 0600 run-folder
config.toml of ``train``, which its ranks read back, holds the URL as typed)."""

from __future__ import annotations

import json
import os
import random
import stat
from pathlib import Path

import pytest

from gpufeed.core.redact import redact
from tests.common.cli import invoke
from tests.common.shards import write_tiny_shards

# --------------------------------------------------------------------------- the parser, over many shapes

SHAPES = ["S3cr3tPW", "p@ss", "p@ss@word", "pa:ss:wd", 'qu"ote', "it's", "two words", "p%40ss%20w", "pässwörd✓",
          "a b@c:d\"e'f", "@lead", "trail@", "p://nested@x", "pa/ss", "pa?ss", "pa#ss", "p\\ss", "<p>", "p;w,x"]
"""Password shapes: ``@``, ``:``, quotes, spaces, percent-escapes, unicode, and the ``/?#`` RFC 3986 wants
escaped."""

CONTEXTS = ["{u}", "error: {u}: not found (HTTP 404)", "{u}/train-{{000000..000003}}.tar",
            "pipe:curl -s {u}/train-000001.tar", 'shards = "{u}"\nmanifest = "x"', "{u!r} is refused",
            "see {u}, then http://other.example/x", "[{u}]"]


def _url(scheme: str, user: str | None, pw: str, host: str, path: str) -> str:
    cred = pw if user is None else f"{user}:{pw}"
    return f"{scheme}://{cred}@{host}{path}"


def _random_password(rng: random.Random) -> str:
    alphabet = "abcXYZ019@:\"' %!$&()*+,;=-._~é✓"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 16))) + "Z9"


@pytest.mark.parametrize("pw", SHAPES + [_random_password(random.Random(seed)) for seed in range(40)])
def test_no_password_shape_survives_any_context(pw: str) -> None:
    from gpufeed.core.redact import split_url

    for scheme in ("http", "https", "HTTP", "S3", "gs", "git+ssh"):
        for host, path in (("127.0.0.1:8080", "/set"), ("bucket", "/a/b.tar"), ("host.example", ""),
                           ("[::1]:9", "?q=1")):
            for user in ("alice", None) if not set(pw) & set("/?#") else ("alice",):  # a lone token: see redact.py
                url = _url(scheme, user, pw, host, path)
                for ctx in CONTEXTS:
                    text = ctx.format(u=url)
                    out = redact(text)
                    assert pw not in out, (text, out)
                    assert redact(out) == out  # idempotent
                    name, colon, _ = (f"{user}:{pw}" if user else pw).partition(":")  # RFC 3986: user:password
                    hidden = f"{scheme}://{name + ':' if colon else ''}***@{host}"
                    assert hidden in out, (text, out)  # user name and host kept, the rest of the text too
                assert split_url(url)[2] == host and (split_url(url)[1] or "").endswith(pw)


def test_redact_leaves_text_without_userinfo_alone() -> None:
    for text in ("/data/shards", "http://host:8080/a@b", "http://[::1]:80/x@y", "gpufeed io http://host/set: ok",
                 "s3://bucket/key", "user@example.com wrote", "http://host: timeout", "no url at all"):
        assert redact(text) == text


def test_redact_obj_hides_every_string_of_a_record_keys_included() -> None:
    from gpufeed.core.redact import redact_obj

    rec = {"path": "http://u:PW1@h/x", "notes": ["fine", "s3://k:PW2@b/y"], "http://t:PW3@h": 1, "n": 3.5}
    out = json.dumps(redact_obj(rec))
    assert not {"PW1", "PW2", "PW3"} & set(out.replace('"', " ").replace(":", " ").replace("@", " ").split())
    assert "PW" not in out and redact_obj(rec)["n"] == 3.5


def test_filesystem_of_a_url_is_its_host_never_its_userinfo() -> None:
    from gpufeed.measure.storage_probe import filesystem_of

    assert filesystem_of("HTTP://alice:p@ss w0rd@127.0.0.1:81/set") == ("http", "127.0.0.1:81")
    assert filesystem_of("https://alice:pa/ss@127.0.0.1:81/set") == ("https", "127.0.0.1:81")
    assert filesystem_of("s3://KEY:SECRET@bucket/set") == ("s3", "bucket")


def test_upper_case_schemes_are_urls_not_paths() -> None:
    from gpufeed.shardset.source import is_remote, is_url, normal_url, source_name

    for spec in ("HTTP://h/set", "Https://h/set", "S3://b/set", "GS://b/set"):
        assert is_url(spec) and is_remote(spec)
        assert normal_url(spec).split("://")[0] == spec.split("://")[0].lower()
    assert source_name("HTTP://h/x/train-000001.tar") == "train-000001.tar"
    assert not is_url("/data/http/set") and not is_url("ftp://h/set") and not is_url("HTTPX://h")


def test_errors_and_the_cli_say_no_password(capsys: pytest.CaptureFixture[str]) -> None:
    """A GpufeedError, an OSError naming a URL and an unexpected exception all end as one redacted sentence."""
    from gpufeed.cli import run_job
    from gpufeed.core.errors import DataError

    assert "pw@" not in str(DataError('http://u:"pw@x@h/set: no manifest'))

    def raises(exc: BaseException):
        def job():
            raise exc
        return job

    for exc, code in ((OSError(2, "No such file", "HTTP://u:pw @x@h/set"), 2),
                      (ValueError("bad answer from https://tok en@h/set"), 1),
                      (DataError("s3://KEY:pw@x@b/set unreadable"), 2)):
        with pytest.raises(SystemExit) as e:
            run_job(raises(exc), str, False)
        assert e.value.code == code
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "pw" not in err and "tok en" not in err, err


def test_a_manifest_keeps_its_classes_and_hides_its_options(tmp_path: Path) -> None:
    """manifest.json is data read back: its class names are written as they are, only ``options`` (the record of
    how the set was made) has URL passwords hidden."""
    from gpufeed.shardset.manifest import read_manifest, write_manifest

    folder = write_tiny_shards(tmp_path / "set", [2, 2])
    m = read_manifest(folder)
    import dataclasses

    odd = ["x://not:a@secret", *m.classes[1:]]
    write_manifest(folder, dataclasses.replace(m, classes=odd, options={"source": "http://u:PWD@h/set"}))
    again = read_manifest(folder)
    assert again.classes == odd and "PWD" not in (folder / "manifest.json").read_text()


# --------------------------------------------------------------------------- the real commands


PW = 'p@ss w"o\'rd:Z9'
"""A password with ``@``, a space, both quotes and a colon: it works over HTTP (aiohttp sends it) and the old
pattern showed part of it."""


@pytest.fixture
def served(http_server):
    write_tiny_shards(http_server.root / "set", [6, 6], image_px=32)
    return http_server


def _with_password(server, scheme: str = "http") -> str:
    return f"{scheme}://alice:{PW}@{server.url.split('://', 1)[1]}/set"


def _leaks(folder: Path, allowed: set[Path] = frozenset()) -> list[str]:
    """Files under ``folder`` whose bytes (Parquet: whose decoded strings too) hold the password."""
    found = []
    for p in sorted(folder.rglob("*")):
        if not p.is_file() or p in allowed:
            continue
        if PW.encode() in p.read_bytes() or "ss w" in p.read_bytes().decode("utf-8", "replace"):
            found.append(str(p))
        elif p.suffix == ".parquet":
            import pyarrow.parquet as pq

            if "ss w" in json.dumps(pq.read_table(p).to_pylist(), default=str):
                found.append(str(p))
    return found


@pytest.mark.parametrize("scheme", ["http", "HTTP"])
def test_io_on_a_url_with_a_password_prints_and_records_none_of_it(served, tmp_path: Path, scheme: str) -> None:
    from gpufeed.measure.storage_probe import io_record_rate

    url = _with_password(served, scheme)
    run = tmp_path / "run"
    out = {}
    for as_json in (False, True):
        r = invoke(["io", url, "--seconds", "0.2", "--max-readers", "1", "--run-dir", run,
                    *(["--json"] if as_json else [])])
        out[as_json] = r
        assert "ss w" not in r.stdout + r.stderr and PW not in r.stdout + r.stderr
    rec = json.loads(out[True].stdout)
    [loc] = rec["locations"]
    assert loc["fs_type"] == "http" and loc["mount"] == served.url.split("://", 1)[1] and loc["files"] == 2
    assert loc["path"] == f"{scheme}://alice:***@{loc['mount']}/set" and loc["path"] in out[False].stdout
    assert served.gets("/set/train-000000.tar") >= 1  # the upper-case scheme was read as a URL, not a path
    assert not _leaks(run) and (run / "summary.json").is_file()
    # the record is still found for the URL typed with its password (both hidden the same way)
    assert io_record_rate(run / "summary.json", url).path == loc["path"]


def test_a_failing_url_is_one_sentence_without_its_password_even_verbose(served) -> None:
    url = _with_password(served).replace("/set", "/nothing")
    for env in ({}, {"GPUFEED_VERBOSE": "1"}):
        r = invoke(["io", url], expect=2, env=env)
        assert "ss w" not in r.stdout + r.stderr and "alice:***@" in r.stderr, r.stderr
        r = invoke(["verify", url, "--no-decode"], expect=2, env=env)
        assert "ss w" not in r.stdout + r.stderr and "alice:***@" in r.stderr, r.stderr


def test_tune_out_on_a_url_with_a_password_writes_none_of_it(served, tmp_path: Path) -> None:
    from gpufeed.config import load_config
    from gpufeed.tune import PASSWORD_REMOVED

    out, run = tmp_path / "tuned.toml", tmp_path / "run"
    r = invoke(["tune", _with_password(served, "HTTP"), "--budget", "6", "--max-workers", "0", "--batch-size", "4",
                "--image-size", "16", "--repeats", "1", "--window", "0.2", "--storage-probe-s", "0", "--device",
                "cpu", "--run-dir", run, "--out", out, "--json"])
    assert "ss w" not in r.stdout + r.stderr
    obj = json.loads(r.stdout)
    assert obj["best"] is not None and not [t["error"] for t in obj["trials"] if t["error"]]
    text = out.read_text()
    assert "ss w" not in text and text.splitlines()[0] == f"# {PASSWORD_REMOVED}" and "alice:***@" in text
    assert load_config(out).loader.num_workers == obj["best"]["num_workers"]  # still a config train reads
    assert not _leaks(tmp_path)
    assert "alice:***@" in (run / "config.toml").read_text() and (run / "report.md").is_file()


def test_train_run_folder_holds_the_password_only_in_its_0600_config(served, tmp_path: Path) -> None:
    url = _with_password(served)
    run, ck = tmp_path / "run", tmp_path / "ck"
    r = invoke(["train", "--shards", url, "--arch", "resnet18", "--image-size", "32", "--batch-size", "4",
                "--num-workers", "0", "--amp", "off", "--device", "cpu", "--quiet", "--threads", "1", "--steps", "2",
                "--log-every", "1", "--checkpoint-dir", ck, "--checkpoint-every", "1", "--run-dir", run, "--json"],
               expect=None)
    assert r.exit_code in (0, 1), r.stderr
    assert "ss w" not in r.stdout + r.stderr
    config = run / "config.toml"
    assert stat.S_IMODE(os.stat(config).st_mode) == 0o600
    from gpufeed.config import load_config

    assert load_config(config).train.shards == url  # the ranks read it back as typed
    assert not _leaks(tmp_path, {config})
    assert [p for p in ck.rglob("*") if p.is_file()] and (run / "summary.json").is_file()  # the walk saw them
