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
