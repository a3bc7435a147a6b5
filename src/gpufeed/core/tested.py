"""The torch and torchvision versions the test suite was run with: constraints.txt's pins, kept here because the
wheel does not ship constraints.txt (``tests/test_cli_habits.py`` checks that the two agree). ``gpufeed doctor``
notes an installed version that differs: ``pip install gpufeed`` on a GPU server may pull a newer torch."""

from __future__ import annotations

TESTED_VERSIONS: dict[str, str] = {
    "torch": "2.14.1",
    "torchvision": "0.29.1",
}
"""Distribution name -> the exact version of constraints.txt."""


def base_version(version: str) -> str:
    """``2.14.1+cu130`` -> ``2.14.1``: the release without the local build label (the CUDA variant)."""
    return version.split("+", 1)[0].strip()
