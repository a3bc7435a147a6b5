"""``gpufeed shard --engine ray``: Ray tasks write the local engine's bytes; a task that fails is retried by Ray or
reported in one sentence. Ray starts once for this module (2 CPUs, local).

Not collected by the main suite (the name is not ``test_*.py``): ``tests/test_shard_ray.py`` runs this module in an
interpreter of its own, so that Ray's driver, which can end its process from C++ (``_exit(1)`` when it loses its
GCS), can never take the whole suite with it."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'gpufeed[ray]')")

from gpufeed.config import ShardConfig  # noqa: E402
from gpufeed.core.errors import RunError  # noqa: E402
from gpufeed.shard import write_shards  # noqa: E402
from gpufeed.shard import engine_ray  # noqa: E402
from tests.test_shard_split import folder_with_rejects, local_set, outputs  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    import logging
    import os

    root = str(Path(__file__).parent.parent)  # the workers import this module's task functions
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    yield
    ray.shutdown()


def test_ray_writes_the_local_bytes_with_rejects_and_transcodes(tmp_path: Path) -> None:
    src = folder_with_rejects(tmp_path / "src")
    for opts in ({"shard_samples": 10, "max_size": 12}, {"shard_samples": 10, "check": "header"}):
        ref = local_set(tmp_path / opts.get("check", "full"), src, workers=2, **opts)
        dest = tmp_path / opts.get("check", "full") / "ray" / "out"
        report = write_shards(ShardConfig(src=str(src), dest=str(dest), engine="ray", **opts), progress=False)
        assert report.workers == 2 and report.num_rejected == 1
        assert outputs(dest) == outputs(ref)


def test_ray_on_the_shipped_fixture(tmp_path: Path) -> None:
    import tarfile

    src = tmp_path / "src"
    with tarfile.open(FIXTURES / "webdataset-sample.tgz") as tf:
        members = [m for m in tf.getmembers() if m.isfile() and m.name.endswith((".jpg", ".jpeg", ".png"))]
        for k, m in enumerate(members[:40]):
            data = tf.extractfile(m).read()
            (src / f"class_{k % 3}").mkdir(parents=True, exist_ok=True)
            (src / f"class_{k % 3}" / Path(m.name).name.replace("/", "_")).write_bytes(data)
    ref = local_set(tmp_path, src, shard_samples=8, workers=1)
    dest = tmp_path / "ray" / "out"
    write_shards(ShardConfig(src=str(src), dest=str(dest), engine="ray", shard_samples=8), progress=False)
    assert outputs(dest) == outputs(ref)


def _flaky(marker: str, fn, *args):
    """Raise an OSError the first time (a storage hiccup), then run ``fn``."""
    import os

    if not os.path.exists(marker):
        open(marker, "w").close()
        raise OSError(5, "Input/output error (injected)", marker)
    return fn(*args)


def test_a_task_that_raises_is_retried_then_reported(tmp_path: Path, monkeypatch) -> None:
    src = folder_with_rejects(tmp_path / "src", per_class=6)
    ref = local_set(tmp_path, src, shard_samples=4, workers=1)
    real = engine_ray.RayPool.submit
    marker = str(tmp_path / "failed-once")

    def flaky_submit(self, fn, *args):
        return real(self, _flaky, marker, fn, *args)

    monkeypatch.setattr(engine_ray.RayPool, "submit", flaky_submit)
    dest = tmp_path / "ray" / "out"
    write_shards(ShardConfig(src=str(src), dest=str(dest), engine="ray", shard_samples=4), progress=False)
    assert Path(marker).exists() and outputs(dest) == outputs(ref)  # the failed task ran again


def _always_fails(*_args):
    raise ValueError("boom\nsecond line")


def test_a_task_that_keeps_failing_is_one_sentence(tmp_path: Path, monkeypatch, image_folder) -> None:
    real = engine_ray.RayPool.submit
    monkeypatch.setattr(engine_ray.RayPool, "submit", lambda self, fn, *args: real(self, _always_fails, *args))
    with pytest.raises(RunError) as err:
        write_shards(ShardConfig(src=str(image_folder()), dest=str(tmp_path / "out"), engine="ray"), progress=False)
    msg = str(err.value)
    assert "a Ray task (_always_fails) raised ValueError: boom" in msg and "\n" not in msg
