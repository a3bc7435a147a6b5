"""Shared test helpers. Job-specific fixtures live in their own test modules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result


WDS_SAMPLE = Path(__file__).resolve().parent / "fixtures" / "webdataset-sample.tgz"
"""90 samples written by the webdataset project's own tooling (see tests/fixtures/README.md)."""


def invoke(args: list[str], expect: int | None = 0) -> Result:
    """Run the gpufeed CLI in-process; on an unexpected exit code, fail showing stdout and stderr."""
    from gpufeed.cli import cli

    result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    if expect is not None and result.exit_code != expect:
        pytest.fail(
            f"gpufeed {' '.join(map(str, args))} exited {result.exit_code}, expected {expect}\n"
            f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"
        )
    return result


def invoke_json(args: list[str], expect: int | None = 0) -> dict:
    """Run with --json and parse stdout, which must be exactly one JSON object."""
    result = invoke([*args, "--json"], expect=expect)
    out = result.stdout.strip()
    try:
        obj = json.loads(out)
    except json.JSONDecodeError:
        pytest.fail(f"stdout is not one JSON object:\n{out}\n--- stderr ---\n{result.stderr}")
    assert isinstance(obj, dict)
    return obj


def write_image(path: Path, size: tuple[int, int] = (8, 8), color: tuple[int, int, int] = (200, 30, 30),
                fmt: str = "JPEG", mode: str = "RGB", **save: object) -> Path:
    """Write a small image with a gradient (so decoders have real content to agree on)."""
    import numpy as np
    from PIL import Image

    w, h = size
    yy, xx = np.mgrid[0:h, 0:w]
    arr = np.zeros((h, w, 3), dtype=np.uint8)
    arr[..., 0] = (color[0] + 3 * xx) % 256
    arr[..., 1] = (color[1] + 5 * yy) % 256
    arr[..., 2] = (color[2] + xx + yy) % 256
    img = Image.fromarray(arr, "RGB")
    if mode != "RGB":
        img = img.convert(mode)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, fmt, **save)
    return path


@pytest.fixture
def image_folder(tmp_path: Path):
    """Factory: ``image_folder(classes=3, per_class=4, size=(16, 12))`` -> an ImageFolder of small JPEGs."""

    def make(classes: int = 3, per_class: int = 4, size: tuple[int, int] = (16, 12), name: str = "src") -> Path:
        root = tmp_path / name
        for c in range(classes):
            for i in range(per_class):
                write_image(root / f"class_{c}" / f"img_{i:03d}.jpg", size=size,
                            color=(40 * c % 256, 17 * i % 256, 90), quality=95)
        return root

    return make
