"""The threat model, as tests: what a downloaded shard set, checkpoint or config must never be able to do.

gpufeed trusts the command line and the user's own config file. It never trusts file names, manifests,
tar headers, image headers or checkpoints (see docs/threat-model.md). Each section below is one attack
that used to work; each test fails without its fix.
"""

from __future__ import annotations

# --------------------------------------------------------------------------- 1. a shard file name runs a shell command


# --------------------------------------------------------------------------- 2. a checkpoint runs code on --resume


class _Payload:
    """Unpickling this creates ``marker``: the stand-in for any code a crafted checkpoint would run."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


_TRAIN = ["--arch", "resnet18", "--image-size", "32", "--batch-size", "4", "--num-workers", "0", "--amp", "off",
          "--device", "cpu", "--quiet", "--threads", "1"]


def test_resume_refuses_a_checkpoint_that_pickles_code(tmp_path):
    import pickle

    import torch

    from tests.conftest import invoke
    from tests.train_shards import write_tiny_shards

    shards = write_tiny_shards(tmp_path / "shards", [16, 16, 16, 16])
    for container in ("torch.save", "raw pickle"):
        marker = tmp_path / f"PWNED-{container}"
        ck = tmp_path / f"ck-{container}"
        ck.mkdir()
        state = {"format": "gpufeed-train-checkpoint", "version": 2, "arch": "resnet18", "num_classes": 4,
                 "step": 0, "payload": _Payload(str(marker))}
        if container == "torch.save":
            torch.save(state, ck / "last.pt")
        else:
            (ck / "last.pt").write_bytes(pickle.dumps(state))
        res = invoke(["train", "--shards", shards, *_TRAIN, "--steps", "1", "--checkpoint-dir", ck, "--resume",
                      "--run-dir", tmp_path / "run"], expect=2)
        err = res.stderr.strip().splitlines()
        assert len(err) == 1 and str(ck / "last.pt") in err[0] and "Traceback" not in res.stderr, res.stderr
        assert ("is refused" if container == "torch.save" else "is not a gpufeed checkpoint") in err[0]
        assert not marker.exists(), container


def test_a_checkpoint_holds_only_tensors_and_plain_values_and_resumes(tmp_path):
    """What gpufeed writes loads under weights_only=True, and --resume continues from it."""
    import torch

    from tests.conftest import invoke, invoke_json
    from tests.train_shards import write_tiny_shards

    shards = write_tiny_shards(tmp_path / "shards", [16, 16, 16, 16])
    ck = tmp_path / "ck"
    invoke(["train", "--shards", shards, *_TRAIN, "--steps", "1", "--checkpoint-dir", ck, "--run-dir", tmp_path / "a"],
           expect=None)  # exit 1 when the verdict says starved

    def plain(v):
        if isinstance(v, dict):
            return all(isinstance(k, (str, int)) and plain(x) for k, x in v.items())
        if isinstance(v, (list, tuple)):
            return all(plain(x) for x in v)
        return v is None or isinstance(v, (bool, int, float, str, torch.Tensor))

    state = torch.load(ck / "last.pt", map_location="cpu", weights_only=True)
    assert state["step"] == 1 and plain(state)
    s = invoke_json(["train", "--shards", shards, *_TRAIN, "--steps", "2", "--checkpoint-dir", ck, "--resume",
                     "--run-dir", tmp_path / "b"], expect=None)
    assert s["start_step"] == 1 and s["step"] == 2


# --------------------------------------------------------------------------- 3. a tar header hangs the reader


# --------------------------------------------------------------------------- 9. a tiny image asks for gigabytes
