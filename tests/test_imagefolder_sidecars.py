"""Labels against torchvision's ImageFolder (``classes_like``, the hidden-folder note) and the sidecar indexes
that other readers consume (wids' shard index, DALI's ``.idx`` files, timm's ``_info.json``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpufeed.config import ShardConfig
from gpufeed.errors import DataError
from gpufeed.manifest import read_manifest
from gpufeed.shard import CANDIDATE_EXTENSIONS, write_shards
from tests.conftest import invoke, write_image


def shard(src: Path, dest: Path, **kw) -> object:
    kw.setdefault("workers", 1)
    return write_shards(ShardConfig(src=str(src), dest=str(dest), **kw), progress=False)


def jupyter_folder(root: Path) -> Path:
    """An image folder as a notebook user has it: ``.ipynb_checkpoints`` at the root (no image in it), another
    hidden folder that holds an image, hidden files and folders inside classes, an empty class, odd extensions
    (upper case, .jpeg, .ppm, .gif, none) and a nested folder."""
    write_image(root / "cat" / "a.jpg", color=(10, 20, 30))
    write_image(root / "cat" / "B.JPG", color=(11, 20, 30))
    write_image(root / "cat" / ".hidden.jpg", color=(12, 20, 30))
    write_image(root / "cat" / ".sub" / "in_hidden.png", fmt="PNG", color=(13, 20, 30))
    write_image(root / "cat" / "anim.gif", fmt="GIF", color=(14, 20, 30))
    (root / "cat" / "notes").write_text("not an image")
    write_image(root / "dog" / "c.jpeg", color=(15, 20, 30))
    write_image(root / "dog" / "nested" / "d.ppm", fmt="PPM", color=(16, 20, 30))
    write_image(root / "eel" / "e.png", fmt="PNG", color=(17, 20, 30))
    write_image(root / ".hidden_class" / "f.jpg", color=(18, 20, 30))
    (root / ".ipynb_checkpoints").mkdir()
    (root / ".ipynb_checkpoints" / "train-checkpoint.ipynb").write_text("{}")
    (root / "empty").mkdir()
    (root / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    return root


def gpufeed_labels(dest: Path) -> dict[str, int]:
    import pyarrow.parquet as pq

    t = pq.read_table(dest / "index.parquet", columns=["source", "label"]).to_pydict()
    return dict(zip(t["source"], t["label"]))


def imagefolder_labels(src: Path) -> tuple[list[str], dict[str, int]]:
    from torchvision.datasets import ImageFolder

    ds = ImageFolder(str(src), allow_empty=True)
    return ds.classes, {os.path.relpath(p, src).replace(os.sep, "/"): y for p, y in ds.samples}


def test_extensions_are_torchvisions() -> None:
    from torchvision.datasets.folder import IMG_EXTENSIONS

    assert tuple(CANDIDATE_EXTENSIONS) == tuple(IMG_EXTENSIONS)


def test_classes_like_imagefolder_matches_torchvision(tmp_path: Path) -> None:
    from torchvision.datasets.folder import find_classes

    src = jupyter_folder(tmp_path / "src")
    dest = tmp_path / "out"
    rep = shard(src, dest, classes_like="imagefolder", allow_empty_classes=True)
    classes, _ = find_classes(str(src))
    assert classes == [".hidden_class", ".ipynb_checkpoints", "cat", "dog", "eel", "empty"]
    assert rep.classes == classes and read_manifest(dest).classes == classes
    assert sorted(rep.empty_classes) == [".ipynb_checkpoints", "empty"]
    tv_classes, tv = imagefolder_labels(src)
    assert tv_classes == classes
    ours = gpufeed_labels(dest)
    # every file ImageFolder lists is a valid image here: gpufeed stores the same files under the same labels
    assert ours == tv
    assert "cat/.hidden.jpg" in ours and "cat/.sub/in_hidden.png" in ours
    assert read_manifest(dest).options["classes_like"] == "imagefolder"
    assert not any("hidden folder" in w for w in rep.warnings)


def test_classes_like_imagefolder_without_allow_empty_refuses_like_imagefolder(tmp_path: Path) -> None:
    src = jupyter_folder(tmp_path / "src")
    with pytest.raises(DataError, match=r"\.ipynb_checkpoints"):
        shard(src, tmp_path / "out", classes_like="imagefolder")
    from torchvision.datasets import ImageFolder

    with pytest.raises(FileNotFoundError, match=r"\.ipynb_checkpoints"):
        ImageFolder(str(src))


def test_default_skips_hidden_folders_and_says_imagefolder_would_count_them(tmp_path: Path) -> None:
    src = jupyter_folder(tmp_path / "src")
    dest = tmp_path / "out"
    rep = shard(src, dest, allow_empty_classes=True)
    assert rep.classes == ["cat", "dog", "eel", "empty"]
    notes = [w for w in rep.warnings if "ImageFolder" in w]
    assert len(notes) == 1
    assert ".ipynb_checkpoints" in notes[0] and ".hidden_class" in notes[0]
    assert "--classes-like imagefolder" in notes[0]
    assert {i.path for i in rep.ignored if "ImageFolder would count" in i.reason} == {".hidden_class",
                                                                                     ".ipynb_checkpoints"}
    assert "classes_like" not in read_manifest(dest).options  # a default set's manifest is as before
    # the labels differ from ImageFolder's by the two hidden classes before them, which is what the note says
    _, tv = imagefolder_labels(src)
    ours = gpufeed_labels(dest)
    assert ours and all(tv[p] == y + 2 for p, y in ours.items())
    assert "cat/.hidden.jpg" not in ours


def test_no_note_without_hidden_folders(image_folder, tmp_path: Path) -> None:
    src = image_folder(classes=2, per_class=2)
    (src / ".hidden_file").write_text("x")
    rep = shard(src, tmp_path / "out")
    assert not any("ImageFolder" in w for w in rep.warnings)


def test_cli_classes_like_and_note(tmp_path: Path) -> None:
    src = jupyter_folder(tmp_path / "src")
    r = invoke(["shard", str(src), str(tmp_path / "a"), "--workers", "1", "--quiet", "--allow-empty-classes"])
    line = [ln for ln in r.output.splitlines() if ln.strip().startswith("warning:") and "ImageFolder" in ln]
    assert len(line) == 1 and ".ipynb_checkpoints" in line[0]
    r = invoke(["shard", str(src), str(tmp_path / "b"), "--workers", "1", "--quiet", "--allow-empty-classes",
                "--classes-like", "imagefolder"])
    assert read_manifest(tmp_path / "b").classes[:2] == [".hidden_class", ".ipynb_checkpoints"]
    invoke(["shard", str(src), str(tmp_path / "c"), "--classes-like", "nope"], expect=2)
