"""Training checkpoints (``last.pt``): what is saved, when (:meth:`Checkpointer.should_save`, the one cadence
rule), and reading one back with every check before anything is loaded (docs/design.md §5).

A checkpoint holds tensors and plain values only: ``--resume`` reads it with
``torch.load(weights_only=True)`` (:func:`read_checkpoint`, after :func:`_check_archive` bounded what the
archive may expand to) and checks it against the run (format version, arch, classes, every tensor's shape and
dtype, the optimizer's state, the RNG states) before loading anything; nothing is unpickled into objects and a
checkpoint that does not fit is a DataError naming the file. The LR scheduler is not saved: the schedule is a
function of the step.
"""

from __future__ import annotations

import math
import random
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from gpufeed.config import LoaderConfig, TrainConfig
from gpufeed.core.errors import DataError, one_line
from gpufeed.core.records import to_jsonable
from gpufeed.core.redact import redact_obj
from gpufeed.core.world import World

CHECKPOINT_NAME = "last.pt"
CHECKPOINT_FORMAT = "gpufeed-train-checkpoint"
CHECKPOINT_VERSION = 2
"""2: tensors and plain values only (RNG states as tensors), loaded with ``weights_only=True``."""
LOADER_ORDER_KNOBS = ("seed", "batch_size", "num_workers", "shuffle_buffer", "worker_batching", "image_size",
                     "shard_split")
"""[loader] fields that decide the sample order: a resume with other values reads another order."""


class _KeepWriteError:
    """The file ``torch.save`` writes to, keeping the first exception a write raised: torch's C++ writer turns
    it (ENOSPC, EIO, a KeyboardInterrupt) into a RuntimeError ("unexpected pos ...") that names neither the
    file nor the cause."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.error: BaseException | None = None

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except BaseException as exc:
            if self.error is None:
                self.error = exc
            raise

    def flush(self) -> None:
        self._f.flush()


def _atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` through :func:`gpufeed.core.records.atomic_writer` (fsync file, rename, fsync folder), after
    removing the temporaries a killed write left (:func:`gpufeed.core.records.remove_stale_temporaries`).

    A failed write is the OSError that caused it, naming ``path`` (a full disk: ``No space left on device
    (path)``), and a SIGINT during the write is the KeyboardInterrupt, never torch's RuntimeError; the
    temporary is removed and the previous checkpoint is left as it was."""
    from gpufeed.core.records import atomic_writer, remove_stale_temporaries

    remove_stale_temporaries(path)
    try:
        with atomic_writer(path) as f:
            out = _KeepWriteError(f)
            try:
                torch.save(obj, out)
            except RuntimeError:
                if out.error is None:
                    raise
                raise out.error from None
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror or one_line(exc), str(path)) from None


def _rng_state(cuda: bool) -> dict[str, Any]:
    """This process's RNG states as tensors and plain values (what ``torch.load(weights_only=True)`` reads)."""
    import numpy as np

    version, key, gauss = random.getstate()
    name, np_key, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": int(version), "key": torch.tensor(key, dtype=torch.int64), "gauss": gauss},
        "numpy": {"name": str(name), "key": torch.from_numpy(np_key.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if cuda:
        state["cuda"] = torch.cuda.get_rng_state()
    return state


@dataclass(frozen=True)
class RngState:
    """A checkpoint's RNG states, checked by applying them to scratch generators; :meth:`apply` cannot fail."""

    python: tuple[Any, ...]
    numpy: tuple[Any, ...]
    torch: torch.Tensor
    cuda: torch.Tensor | None

    @classmethod
    def parse(cls, state: Any, where: str) -> "RngState":
        import numpy as np

        def bad(what: str) -> DataError:
            return DataError(f"{where}: {what}")

        if not isinstance(state, dict):
            raise bad("the RNG state is not a mapping")
        py, nps, tch, cuda = state.get("python"), state.get("numpy"), state.get("torch"), state.get("cuda")
        try:
            key = py["key"]
            if not (isinstance(key, torch.Tensor) and key.dtype == torch.int64 and key.dim() == 1):
                raise TypeError("key is not an int64 vector")
            gauss = py["gauss"]
            if gauss is not None and not isinstance(gauss, float):
                raise TypeError("gauss is not a float")
            python = (int(py["version"]), tuple(int(v) for v in key.tolist()), gauss)
            random.Random().setstate(python)  # raises on a malformed state
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise bad(f"the Python RNG state is malformed ({one_line(exc)})") from None
        try:
            key = nps["key"]
            if not (isinstance(key, torch.Tensor) and key.dtype == torch.int64 and key.dim() == 1
                    and bool(((key >= 0) & (key < 2**32)).all())):
                raise TypeError("key is not a vector of uint32 values")
            if not isinstance(nps["name"], str):
                raise TypeError("name is not a string")
            numpy = (nps["name"], key.numpy().astype(np.uint32), int(nps["pos"]), int(nps["has_gauss"]),
                     float(nps["cached_gaussian"]))
            np.random.RandomState().set_state(numpy)
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise bad(f"the NumPy RNG state is malformed ({one_line(exc)})") from None
        for name, t in (("torch", tch), ("CUDA", cuda)):
            if name == "CUDA" and t is None:
                continue
            if not (isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1):
                raise bad(f"the {name} RNG state is not a byte vector")
        try:
            torch.Generator().set_state(tch)
        except RuntimeError as exc:
            raise bad(f"the torch RNG state is malformed ({one_line(exc)})") from None
        if cuda is not None and torch.cuda.is_available():
            want = torch.cuda.get_rng_state().numel()
            if cuda.numel() != want:
                raise bad(f"the CUDA RNG state has {cuda.numel()} bytes, this GPU's has {want}")
        return cls(python=python, numpy=numpy, torch=tch, cuda=cuda)

    def apply(self) -> None:
        import numpy as np

        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch)
        if self.cuda is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(self.cuda)


def read_checkpoint(path: Path) -> dict[str, Any]:
    """``torch.load(path, weights_only=True)``: tensors and plain values only, nothing is unpickled into
    objects. Anything else (another format, a pickled object, a truncated or junk file) is a DataError."""
    import zipfile

    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; the legacy raw-pickle format is refused
        raise DataError(f"{path} is not a gpufeed checkpoint: not a torch zip archive (truncated, junk or "
                        f"an old torch format)")
    _check_archive(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on pickle protocols: the refusal below says it all
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure to read an untrusted file is a refusal
        if type(exc).__name__ == "UnpicklingError":  # weights_only's refusal of anything but tensors and values
            raise DataError(f"{path} is refused: the safe loader (tensors and plain values only) rejected it, and "
                            f"loading it in full could run code") from None
        raise DataError(f"{path} cannot be read: truncated or corrupt ({type(exc).__name__}: "
                        f"{one_line(exc)[:200]})") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise DataError(f"{path} is not a gpufeed train checkpoint")
    if state.get("version") != CHECKPOINT_VERSION:
        raise DataError(f"{path} has checkpoint version {_short(state.get('version'))}, this gpufeed reads "
                        f"version {CHECKPOINT_VERSION}; start without --resume")
    return state


MAX_CHECKPOINT_ENTRIES = 100_000
"""Records in a checkpoint archive (resnet101 with momentum buffers has ~1,000)."""


def _check_archive(path: Path) -> None:
    """Refuse a checkpoint archive that would expand beyond its size before ``torch.load`` reads it.

    ``torch.save`` stores every record uncompressed; a compressed record (a few KB inflating to gigabytes) or
    declared sizes larger than the file are not ours, so memory stays bounded by the file's own size."""
    import zipfile

    size = path.stat().st_size
    try:
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise DataError(f"{path} cannot be read: not a readable zip archive ({one_line(exc)[:120]})") from None
    if len(infos) > MAX_CHECKPOINT_ENTRIES:
        raise DataError(f"{path} holds {len(infos)} records; a gpufeed checkpoint has at most {MAX_CHECKPOINT_ENTRIES:,}")
    packed = [i.filename for i in infos if i.compress_type != zipfile.ZIP_STORED]
    if packed:
        raise DataError(f"{path} is not a gpufeed checkpoint: record {packed[0][:80]!r} is compressed "
                        f"(torch.save stores records uncompressed)")
    declared = sum(i.file_size for i in infos)
    if declared > size:
        raise DataError(f"{path} declares {declared} bytes of records in a {size}-byte file")


def _short(value: Any) -> str:
    """An untrusted value for a message: a bounded repr (depth and length), at most 60 characters."""
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother = 3, 40, 40
    try:
        text = r.repr(value)
    except (RecursionError, ValueError):  # a nested structure deeper than the interpreter recurses
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."


def _count(state: dict[str, Any], key: str, where: Path) -> int:
    v = state.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**53:
        raise DataError(f"{where}: {key} is {_short(v)}, not a non-negative integer")
    return v


def _check_like(value: Any, template: Any, what: str) -> None:
    """``value`` (from a checkpoint) has ``template``'s structure: the same keys, list lengths, tensor shapes
    and dtypes, kinds of scalars. Raises ValueError naming the first difference."""
    if isinstance(template, torch.Tensor):
        if not isinstance(value, torch.Tensor) or value.shape != template.shape or value.dtype != template.dtype:
            got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{what} is {got}, this run has {template.dtype} {tuple(template.shape)}")
    elif isinstance(template, dict):
        if not isinstance(value, dict):
            raise ValueError(f"{what} is not a mapping")
        extra = [k for k in value if k not in template]
        if extra:
            raise ValueError(f"{what} has the unknown key {_short(extra[0])}")
        missing = [k for k in template if k not in value]
        if missing:
            raise ValueError(f"{what} lacks the key {missing[0]!r}")
        for k, v in value.items():
            _check_like(v, template[k], f"{what}[{k!r}]")
    elif isinstance(template, (list, tuple)):
        if not isinstance(value, (list, tuple)) or len(value) != len(template):
            raise ValueError(f"{what} does not have {len(template)} entries")
        for i, (v, t) in enumerate(zip(value, template)):
            _check_like(v, t, f"{what}[{i}]")
    elif isinstance(template, bool) or template is None or isinstance(template, str):
        if type(value) is not type(template):
            raise ValueError(f"{what} is {_short(value)}, expected a {type(template).__name__}")
    elif isinstance(template, (int, float)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{what} is {_short(value)}, not a finite number")
    else:
        raise ValueError(f"{what}: cannot check a {type(template).__name__}")



def set_identity(manifest: Any) -> dict[str, Any]:
    """The shard set a run trains on, as its checkpoint records it: the sha256 of the canonical shard list (each
    shard's name, sample count, bytes and sha256, in manifest order; not the manifest's bytes, so a staged copy of
    the same set is the same set), its samples and shards (for the message when they differ)."""
    import hashlib
    import json

    listing = [[s.name, s.num_samples, s.bytes, s.sha256] for s in manifest.shards]
    digest = hashlib.sha256(json.dumps(listing, separators=(",", ":")).encode("utf-8", "surrogatepass")).hexdigest()
    return {"sha256": digest, "num_samples": int(manifest.num_samples), "num_shards": len(manifest.shards),
            "labels": labels_identity(manifest)}


def labels_identity(manifest: Any) -> str:
    """The sha256 of what a sample's label index means: the class list, in order, and the label source (a set
    indexed again with another class order or label member holds the same shards but other labels)."""
    import hashlib
    import json

    text = json.dumps([list(manifest.classes), manifest.label], separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _saved_identity(state: dict[str, Any], path: Path) -> dict[str, Any] | None:
    """The checkpoint's ``shard_set`` (None when written before the field), checked: untrusted input."""
    saved = state.get("shard_set")
    if saved is None:
        return None
    if not (isinstance(saved, dict) and set(saved) - {"labels"} == {"sha256", "num_samples", "num_shards"}
            and all(isinstance(saved.get(k, "-" * 64), str) and len(saved.get(k, "-" * 64)) == 64
                    for k in ("sha256", "labels"))):
        raise DataError(f"{path}: shard_set is {_short(saved)}, not a shard-set identity")
    for k in ("num_samples", "num_shards"):
        _count(saved, k, path)
    return saved


class Position(Protocol):
    """Where the loader stands (the loader's ``LoaderPosition``, passed in as ``position`` to
    :class:`Checkpointer`): built from (epoch, batches consumed), written as a dict, read back with its checks."""

    epoch: int
    batches_consumed: int

    def to_dict(self) -> dict[str, int]: ...


@dataclass(frozen=True)
class Resume:
    """Where a checked checkpoint puts the run back; its model, optimizer and scaler states are loaded already."""

    step: int
    epoch: int
    step_in_epoch: int
    rng: RngState
    """This rank's RNG states, to apply once the loader is back at its position."""
    position: Position
    """Where the loader resumes: the batches of ``epoch`` already trained on, passed over without decoding."""


class Checkpointer:
    """``checkpoint_dir/last.pt`` of one run: when to save (:meth:`should_save`), what (:meth:`save`), and
    loading it back after every check (:meth:`load`).

    It holds the run's stateful parts (model, optimizer, scaler); the position in the run (step, epoch, step in
    the epoch) is passed to :meth:`save` and returned by :meth:`load`. Notes for the summary go to ``notes``."""

    def __init__(self, cfg: TrainConfig, loader_cfg: LoaderConfig, world: World, *, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, num_classes: int,
                 total_steps: int, gather: Callable[[Any], list[Any]], notes: list[str],
                 shard_set: dict[str, Any] | None = None, position: Any = None) -> None:
        self.path = Path(cfg.checkpoint_dir) / CHECKPOINT_NAME if cfg.checkpoint_dir else None
        self.every = cfg.checkpoint_every
        self.cfg, self.loader_cfg, self.world = cfg, loader_cfg, world
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.num_classes, self.total_steps = num_classes, total_steps
        self.gather, self.notes = gather, notes
        self.shard_set = shard_set
        """:func:`set_identity` of the training set (None: no shard set, e.g. synthetic)."""
        self.position = position
        """The loader's position type (``LoaderPosition``: ``position(epoch, batches)``, ``to_dict``,
        ``from_dict``); needed by :meth:`save` and :meth:`load`."""

    def should_save(self, step: int, *, epoch_end: bool, run_end: bool) -> bool:
        """THE cadence, asked once after every optimizer step: with a checkpoint folder, save every
        ``checkpoint_every`` steps (0: not on a count), at the end of every epoch and at the end of the run."""
        if self.path is None:
            return False
        return epoch_end or run_end or (self.every > 0 and step % self.every == 0)

    def save(self, step: int, epoch: int, step_in_epoch: int) -> Path | None:
        """Collective (the RNG states are gathered from every rank); rank 0 writes last.pt atomically.

        Only tensors and plain values (what :func:`read_checkpoint` loads with ``weights_only=True``)."""
        if self.path is None:
            return None
        rngs = self.gather(_rng_state(self.world.is_cuda))
        if self.world.is_main:
            state = {
                "format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION,
                "arch": self.cfg.arch, "num_classes": self.num_classes,
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict(),
                "step": step, "epoch": epoch, "step_in_epoch": step_in_epoch,
                "loader_position": self.position(epoch, step_in_epoch * self.cfg.accum_steps).to_dict(),
                "rng": rngs, "world_size": self.world.world_size,
                "config": redact_obj(to_jsonable(self.cfg)), "loader_config": to_jsonable(self.loader_cfg),
                "total_steps": self.total_steps, "shard_set": self.shard_set,
            }
            _atomic_torch_save(state, self.path)
        if self.world.is_distributed:
            import torch.distributed as dist

            dist.barrier()
        return self.path

    def load(self) -> Resume | None:
        """Load last.pt into the model, optimizer and scaler after checking that it belongs to this run
        (arch, classes, every tensor's shape, the RNG states); None (and a note) when there is none.
        A checkpoint that does not match or cannot be read is a DataError naming the file, and nothing is
        loaded then."""
        path = self.path
        if path is None or not path.exists():
            self.notes.append(f"resume: no checkpoint at {path}; starting from step 0")
            return None
        state = read_checkpoint(path)
        if state.get("arch") != self.cfg.arch:
            raise DataError(f"{path} was written for arch {_short(state.get('arch'))}, this run trains "
                            f"{self.cfg.arch!r}")
        if state.get("num_classes") != self.num_classes:
            raise DataError(f"{path} was written for {_short(state.get('num_classes'))} classes, this run has "
                            f"{self.num_classes}")
        step, epoch, step_in_epoch = (_count(state, k, path) for k in ("step", "epoch", "step_in_epoch"))
        try:
            position = self.position.from_dict(state.get("loader_position"))
        except DataError as exc:
            raise DataError(f"{path}: {exc}") from None
        if position != self.position(epoch, step_in_epoch * self.cfg.accum_steps):
            raise DataError(f"{path}: loader_position {position.to_dict()} does not match epoch {epoch}, step "
                            f"{step_in_epoch} of it, x {self.cfg.accum_steps} micro-batches")
        if not self._same_set(state, path, epoch, step_in_epoch):  # resume_other_set: this epoch from its start
            step_in_epoch, position = 0, self.position(epoch, 0)
        rng = self._rank_rng(state, path)
        scaler = state.get("scaler")
        try:
            _check_like(state.get("model"), self.model.state_dict(), "model")
            self._check_optimizer_state(state.get("optimizer"))
            if self.scaler.is_enabled() and scaler:
                _check_like(scaler, self.scaler.state_dict(), "scaler")
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            if self.scaler.is_enabled() and scaler:
                self.scaler.load_state_dict(scaler)
        except (ValueError, RuntimeError, KeyError, TypeError) as exc:
            raise DataError(f"{path} does not match this run: {one_line(exc)}") from None
        if self.scaler.is_enabled() and not scaler:
            self.notes.append("resume: the checkpoint has no fp16 loss scale; the GradScaler starts afresh")
        self._note_changes(state)
        return Resume(step=step, epoch=epoch, step_in_epoch=step_in_epoch, rng=rng, position=position)

    def _same_set(self, state: dict[str, Any], path: Path, epoch: int, step_in_epoch: int) -> bool:
        """Whether the checkpoint was written for this run's shard set. Another set is refused (DataError) unless
        ``resume_other_set``: then False and a note (the epoch restarts); a checkpoint from before the identity was
        recorded resumes with a note that it was not checked."""
        saved = _saved_identity(state, path)
        ours = self.shard_set
        if saved is None or ours is None:
            if saved is None and ours is not None:
                self.notes.append("resume: the checkpoint records no shard-set identity (written by an older "
                                  "gpufeed), so it is not checked that it trained on this set")
            return True
        if saved["sha256"] == ours["sha256"]:
            if "labels" not in saved:
                self.notes.append("resume: the checkpoint records no class list (written by an older gpufeed), so it "
                                  "is not checked that its labels mean the same classes")
            if saved.get("labels", ours.get("labels")) == ours.get("labels"):
                return True
        change = (f"{saved['num_samples']} samples in {saved['num_shards']} shard(s) -> {ours['num_samples']} in "
                  f"{ours['num_shards']}")
        other, why = "other shards", "would pass over samples of this set never trained on"
        if saved["sha256"] == ours["sha256"]:  # the labels differ
            change, other = "the same shards", "other classes, another class order or another label source"
            why = "would go on training with label indices that now name other classes"
        if not getattr(self.cfg, "resume_other_set", False):
            raise DataError(f"{path} was written for another shard set ({change}, {other}): resuming at step "
                            f"{step_in_epoch} of epoch {epoch} {why}; "
                            f"pass --resume-other-set to keep the step, weights and LR and read epoch {epoch} of this "
                            f"set from its beginning, or start without --resume")
        self.notes.append(f"resume: the checkpoint was written for another shard set ({change}); with "
                          f"resume_other_set epoch {epoch} of this set is read from its beginning (the checkpoint "
                          f"had trained {step_in_epoch} step(s) of its epoch)")
        return False

    def _rank_rng(self, state: dict[str, Any], path: Path) -> RngState:
        """This rank's RNG states (rank 0's when the checkpoint was written by another number of ranks)."""
        ranks = _count(state, "world_size", path)
        rngs = state.get("rng")
        if not isinstance(rngs, list) or len(rngs) != ranks or not rngs:
            raise DataError(f"{path}: the RNG states are not one per rank of its {ranks}")
        if ranks != self.world.world_size:
            self.notes.append(f"resume: the checkpoint was written by {ranks} rank(s), this run has "
                              f"{self.world.world_size}: the data order differs from an uninterrupted run")
        return RngState.parse(rngs[self.world.rank] if ranks == self.world.world_size else rngs[0], str(path))

    def _check_optimizer_state(self, saved: Any) -> None:
        """SGD's state dict: the same parameter groups (options of the same kinds), momentum buffers shaped
        like their parameters. Raises ValueError naming the first difference."""
        ours = self.optimizer.state_dict()
        if not isinstance(saved, dict) or set(saved) != {"state", "param_groups"}:
            raise ValueError("optimizer is not an SGD state dict")
        _check_like(saved["param_groups"], ours["param_groups"], "optimizer param_groups")
        for g, (a, b) in enumerate(zip(saved["param_groups"], ours["param_groups"])):
            if list(a["params"]) != list(b["params"]):
                raise ValueError(f"optimizer param_groups[{g}] holds other parameters")
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if not isinstance(saved["state"], dict):
            raise ValueError("optimizer state is not a mapping")
        for k, v in saved["state"].items():
            if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < len(params):
                raise ValueError(f"optimizer state names the unknown parameter {_short(k)}")
            _check_like(v, {"momentum_buffer": params[k].detach()}, f"optimizer state[{k}]")

    def _note_changes(self, state: dict[str, Any]) -> None:
        """Notes on what differs from the checkpoint's run and still resumes: the planned steps, the sample order."""
        if state.get("total_steps") != self.total_steps:
            self.notes.append(f"resume: the checkpoint planned {_short(state.get('total_steps'))} steps, this "
                              f"run {self.total_steps}; the LR schedule follows this run")
        saved = state.get("loader_config") if isinstance(state.get("loader_config"), dict) else {}
        changed = [k for k in LOADER_ORDER_KNOBS if k in saved and saved[k] != getattr(self.loader_cfg, k)]
        if changed:
            self.notes.append(f"resume: [loader] {', '.join(changed)} changed since the checkpoint: the rest of the "
                              f"epoch reads another sample order than an uninterrupted run")
