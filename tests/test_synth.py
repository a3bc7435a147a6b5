"""gpufeed synth: an ImageNet-like ImageFolder, deterministic per seed, whatever the worker count."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.common.cli import invoke, invoke_json

pytest.importorskip("skimage")

from gpufeed.config import SynthConfig  # noqa: E402
from gpufeed.core.errors import ConfigError, DataError  # noqa: E402
from gpufeed.synth import render_synth, synthesize  # noqa: E402


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_same_seed_same_bytes_whatever_the_workers(tmp_path: Path) -> None:
    a = synthesize(SynthConfig(dest=str(tmp_path / "a"), images=16, classes=4, seed=7, workers=1))
    b = synthesize(SynthConfig(dest=str(tmp_path / "b"), images=16, classes=4, seed=7, workers=2))
    c = synthesize(SynthConfig(dest=str(tmp_path / "c"), images=16, classes=4, seed=8, workers=2))
    fa, fb, fc = _files(tmp_path / "a"), _files(tmp_path / "b"), _files(tmp_path / "c")
    assert a.workers == 1 and b.workers == 2
    assert len(fa) == 16 and fa == fb
    assert fa.keys() == fc.keys() and all(fa[k] != fc[k] for k in fa)
    assert a.total_bytes == b.total_bytes == sum(map(len, fa.values()))


def test_class_layout_and_images(tmp_path: Path) -> None:
    from PIL import Image

    rep = synthesize(SynthConfig(dest=str(tmp_path / "s"), images=14, classes=5, seed=0, workers=2))
    root = tmp_path / "s"
    assert sorted(p.name for p in root.iterdir()) == [f"n{c:04d}" for c in range(5)]
    counts = [len(list((root / f"n{c:04d}").iterdir())) for c in range(5)]
    assert counts == [3, 3, 3, 3, 2]  # image i -> class i % classes
    assert not list(root.rglob(".*")), "temporary files left behind"
    widths, heights = [], []
    for p in root.rglob("*.jpg"):
        assert p.name.startswith(p.parent.name + "_")
        with Image.open(p) as im:
            assert im.format == "JPEG" and im.mode in ("RGB", "L", "CMYK")
            im.load()
            widths.append(im.width)
            heights.append(im.height)
    assert rep.num_images == 14 and rep.num_classes == 5
    assert rep.mean_width == pytest.approx(sum(widths) / 14)
    assert rep.mean_height == pytest.approx(sum(heights) / 14)
    assert 20_000 < rep.mean_bytes < 400_000
    assert "14 images in 5 classes" in render_synth(rep)


def test_size_and_mode_mix_is_imagenet_like() -> None:
    """The size/mode draw itself, on many samples (cheap: nothing is rendered)."""
    import numpy as np

    from gpufeed.synth import _P_CMYK, _P_GRAY, _image_size

    sizes = np.array([_image_size(np.random.default_rng([0, i])) for i in range(4000)])
    w, h = sizes[:, 0], sizes[:, 1]
    assert 430 < w.mean() < 560 and 360 < h.mean() < 460  # ImageNet: around 500x400
    portrait = (h > w).mean()
    assert 0.15 < portrait < 0.35
    assert 0.01 < (np.maximum(w, h) > 1000).mean() < 0.06
    assert 0.01 < (np.minimum(w, h) < 128).mean() < 0.06
    assert sizes.min() >= 16 and sizes.max() <= 2000
    assert 0 < _P_GRAY < 0.05 and 0 < _P_CMYK < 0.01


def test_refuses_a_non_empty_dest_unless_overwrite(tmp_path: Path) -> None:
    dest = tmp_path / "s"
    synthesize(SynthConfig(dest=str(dest), images=3, classes=3, seed=0, workers=1))
    with pytest.raises(DataError, match="--overwrite"):
        synthesize(SynthConfig(dest=str(dest), images=2, classes=2, seed=0, workers=1))
    rep = synthesize(SynthConfig(dest=str(dest), images=2, classes=2, seed=0, workers=1, overwrite=True))
    assert rep.num_images == 2 and sorted(p.name for p in dest.iterdir()) == ["n0000", "n0001"]
    (dest / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="did not write"):
        synthesize(SynthConfig(dest=str(dest), images=2, classes=2, seed=0, workers=1, overwrite=True))
    assert (dest / "notes.txt").exists()


def test_config_checks() -> None:
    with pytest.raises(ConfigError, match="images"):
        SynthConfig(images=0)
    with pytest.raises(ConfigError, match="classes"):
        SynthConfig(images=2, classes=3)
    with pytest.raises(ConfigError, match="workers"):
        SynthConfig(workers=0)


def test_missing_scikit_image_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "skimage", None)  # makes `import skimage...` raise ImportError
    monkeypatch.setitem(sys.modules, "skimage.data", None)
    with pytest.raises(ConfigError, match=r"pip install 'gpufeed\[synth\]'"):
        synthesize(SynthConfig(dest=str(tmp_path / "s"), images=2, classes=1))
    assert not (tmp_path / "s").exists()
    res = invoke(["synth", tmp_path / "t", "--images", 2, "--classes", 1], expect=2)
    assert "gpufeed[synth]" in res.stderr and "Traceback" not in res.stderr


def test_cli_json(tmp_path: Path) -> None:
    obj = invoke_json(["synth", tmp_path / "s", "--images", 6, "--classes", 3, "--seed", 1, "--workers", 1])
    assert obj["num_images"] == 6 and obj["num_classes"] == 3 and obj["seed"] == 1
    assert obj["dest"] == str(tmp_path / "s")
    assert len(list((tmp_path / "s").rglob("*.jpg"))) == 6
    invoke(["synth", tmp_path / "s", "--images", 6], expect=2)  # not empty, no --overwrite
    invoke(["synth", tmp_path / "u", "--images", 2, "--classes", 3], expect=2)
