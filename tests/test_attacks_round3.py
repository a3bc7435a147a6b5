"""Round 3 of the threat model's attacks (issue 16): each test carries out one attack that worked against main
before its fix (docs/threat-model.md names the rule each one checks)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import invoke, write_image, write_tar

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
