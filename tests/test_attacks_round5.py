"""The third attacker's pass (issue 16): a URL with an empty authority, a shard swapped in DEST with a sidecar
that matches it, a record's number past any measurement in the report, and Ray's environment set before Ray is
imported. Each test failed before its fix."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

from tests.common import invoke


def test_a_url_with_a_third_slash_is_refused_with_its_password_hidden() -> None:
    from gpufeed.core.redact import redact

    assert redact("http:///u:SECRETPW@h/x") == "http:///u:***@h/x"
    assert redact("see http:////a:pw@c/x") == "see http:////a:***@c/x"
    assert redact("file:///tmp/x@y") == "file:///tmp/x@y"  # a path, not a userinfo
    res = invoke(["verify", "http:///u:SECRETPW@127.0.0.1:1/x", "--json"], expect=2)
    assert "SECRETPW" not in res.stdout + res.stderr
    assert "no host" in json.loads(res.stdout)["error"]


def test_a_shard_swapped_in_dest_with_a_matching_sidecar_is_written_again(image_folder, tmp_path: Path) -> None:
    """The sidecar in DEST proves only that the file is the one it names; the resumed shard's members must be the
    plan's samples, in order, or it is written again: the set ends byte for byte as a clean run writes it."""
    src = image_folder(classes=2, per_class=6)
    clean, dest = tmp_path / "clean", tmp_path / "dest"
    for d in (clean, dest):
        invoke(["shard", src, d, "--shard-samples", "4", "--workers", "1", "--quiet"])
    (dest / "manifest.json").unlink()
    shutil.copyfile(dest / "train-000002.tar", dest / "train-000000.tar")
    data = (dest / "train-000000.tar").read_bytes()
    (dest / ".gpufeed" / "train-000000.tar.done.json").write_text(json.dumps(
        {"name": "train-000000.tar", "num_samples": 4, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}))
    invoke(["shard", src, dest, "--shard-samples", "4", "--workers", "1", "--quiet"])
    shards = sorted(p.name for p in clean.glob("*.tar"))
    for f in [*shards, "index.parquet"]:  # (_info.json and the manifest name their folder)
        assert (dest / f).read_bytes() == (clean / f).read_bytes(), f
    invoke(["verify", dest])


def test_a_number_past_any_measurement_is_left_out_of_the_report(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "train").mkdir(parents=True)
    (run / "run.json").write_text('{"format": "gpufeed-run", "version": 1, "steps": []}')
    (run / "train" / "summary.json").write_text('{"mode": "measure"}')
    (run / "train" / "log.jsonl").write_text('{"step": 1, "samples_per_s": 1e308}\n{"step": 2, "samples_per_s": 1}\n'
                                             '{"step": 1e308, "samples_per_s": 3}\n')
    invoke(["report", run])
    page = (run / "report.html").read_text()
    assert "nan" not in page.lower().replace("nan-", "")


def test_ray_reads_gpufeeds_environment_when_imported() -> None:
    """Ray reads RAY_DISABLE_FAILURE_SIGNAL_HANDLER into a constant when it is imported: ray_pool sets it first (a
    stub ray module records what it saw at import)."""
    code = r"""
import os, sys, types
seen = {}
ray = types.ModuleType("ray")
class _Stop(Exception): pass
def _import_hook():
    seen["handler"] = os.environ.get("RAY_DISABLE_FAILURE_SIGNAL_HANDLER")
    seen["reconnect"] = os.environ.get("RAY_gcs_rpc_server_reconnect_timeout_s")
    raise ImportError("stub")
class Finder:
    def find_spec(self, name, path=None, target=None):
        if name == "ray":
            _import_hook()
        return None
sys.meta_path.insert(0, Finder())
os.environ.pop("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", None)
os.environ.pop("RAY_ADDRESS", None)
from gpufeed.config import ShardConfig
from gpufeed.core.errors import ConfigError
from gpufeed.shard.engine_ray import ray_pool
try:
    ray_pool(ShardConfig(src="s", dest="d", engine="ray"))
except (ConfigError, ImportError):
    pass
print(seen)
assert seen == {"handler": "1", "reconnect": "30"}, seen
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


def _forge_plan(state: Path, i: int, j: int) -> None:
    """Swap samples i and j of a stored plan (every per-sample column but label and order, and their path bytes),
    then mend plan.bin's digest: the fingerprint in plan.json is left as it was."""
    import numpy as np

    from gpufeed.shard.shardplan import _PLAN_COLUMNS

    meta = json.loads((state / "plan.json").read_text())
    data = bytearray((state / "plan.bin").read_bytes())
    arr = {name: np.frombuffer(data, dtype=_PLAN_COLUMNS[name][0], count=int(np.prod(shape)), offset=off)
           .reshape(shape) for name, shape, off in meta["arrays"]["columns"]}
    offs, blob = arr["path_offsets"], arr["path_blob"]
    a, b = slice(offs[i], offs[i + 1]), slice(offs[j], offs[j + 1])
    assert a.stop - a.start == b.stop - b.start
    for name, col in arr.items():
        if name not in ("label", "order", "path_offsets", "path_blob"):
            col[i], col[j] = col[j].copy(), col[i].copy()
    blob[a], blob[b] = blob[b].copy(), blob[a].copy()
    meta["arrays"]["sha256"] = hashlib.sha256(data).hexdigest()
    (state / "plan.bin").write_bytes(data)
    (state / "plan.json").write_text(json.dumps(meta))


def test_a_plan_changed_in_dest_is_refused_not_followed(image_folder, tmp_path: Path) -> None:
    """A stored plan whose samples are swapped between classes (its fingerprint kept) would store images under
    the other class's label: it must follow from SRC, or the resume is refused; --overwrite plans again."""
    src = image_folder(classes=2, per_class=6)
    dest = tmp_path / "dest"
    invoke(["shard", src, dest, "--shard-samples", "4", "--workers", "1", "--quiet"])
    for name in ("manifest.json", "index.parquet", "train-000000.tar", ".gpufeed/train-000000.tar.done.json"):
        (dest / name).unlink()
    _forge_plan(dest / ".gpufeed", 0, 6)  # class 0's first file <-> class 1's first file
    res = invoke(["shard", src, dest, "--shard-samples", "4", "--workers", "1", "--quiet"], expect=2)
    assert "plan.json does not follow from SRC" in res.stderr and "--overwrite" in res.stderr
    invoke(["shard", src, dest, "--shard-samples", "4", "--workers", "1", "--quiet", "--overwrite"])
    invoke(["verify", dest])
    clean = tmp_path / "clean"
    invoke(["shard", src, clean, "--shard-samples", "4", "--workers", "1", "--quiet"])
    assert (dest / "index.parquet").read_bytes() == (clean / "index.parquet").read_bytes()


def test_a_plan_with_other_class_names_or_a_file_missing_silently_is_refused(image_folder, tmp_path: Path) -> None:
    """Class names swapped in plan.json, or a file of SRC dropped from the plan without a rejection: refused."""
    import numpy as np

    from gpufeed.shard.shardplan import read_plan, save_plan

    src = image_folder(classes=2, per_class=6)
    for case in ("classes", "dropped"):
        dest = tmp_path / case
        invoke(["shard", src, dest, "--shard-samples", "4", "--workers", "1", "--quiet"])
        for name in ("manifest.json", "index.parquet", "train-000000.tar", ".gpufeed/train-000000.tar.done.json"):
            (dest / name).unlink()
        state = dest / ".gpufeed"
        if case == "classes":
            meta = json.loads((state / "plan.json").read_text())
            meta["classes"] = meta["classes"][::-1]
            (state / "plan.json").write_text(json.dumps(meta))
        else:  # the last sample in key order dropped: its position leaves the order, the rest renumbered
            plan = read_plan(str(state))
            n = len(plan.cols["label"])
            keep = plan.cols["order"] != n - 1
            plan.cols = {k: (v[:n - 1] if k != "order" else v[keep]) for k, v in plan.cols.items()}
            plan.paths = plan.paths.take(np.arange(n - 1))
            plan.meta["num_samples"] = n - 1
            plan.meta["shards"][-1]["count"] -= 1
            save_plan(str(state), plan)
        res = invoke(["shard", src, dest, "--shard-samples", "4", "--workers", "1", "--quiet"], expect=2)
        # refused either by the plan's own consistency checks or because it does not follow from SRC
        assert "--overwrite" in res.stderr and res.stderr.count("\n") == 1, (case, res.stderr)
        if case == "classes":
            assert "does not follow from SRC (its class names are not SRC's)" in res.stderr, res.stderr
