"""Round 4 of the threat model's attacks (issue 16, the second attacker's findings F1, F5, F7, F8, F9, F11, F12):
each test carries out one attack that worked against main before its fix (docs/threat-model.md names the rule)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import invoke, write_image
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
