"""The steps of ``gpufeed run``, three functions each (docs/design.md §8): ``prepare`` resolves the step's job
config from the run's config and what earlier steps passed forward (``Carry``), names its inputs' identities and the
paths its job writes; ``execute`` calls the job's public entry function and writes the step's record in its folder;
``output`` says what the step passes forward, derived from the resolved config and read back from the files the
step wrote, whether it ran now or was done before: run.json, which someone else may have written, is never its
source. No step reads another job's internals: what passes forward is read back from the records and files."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from gpufeed.config import Config, LayoutConfig, LoaderConfig, TrainConfig, load_config
from gpufeed.core.errors import ConfigError, DataError
from gpufeed.core.records import to_jsonable, write_json
from gpufeed.core.safefs import link_below
from gpufeed.pipeline.state import MAX_RECORD_BYTES, below, file_sha256
from gpufeed.report.runfolder import read_json

SUMMARY = "summary.json"


@dataclass
class Carry:
    """What passes from step to step. Each field is set by the step that produces it, or from the config when
    that step is not in the run."""

    images: str | None = None
    """The image folder shard reads ([shard] src, or synth's output)."""
    set: str | None = None
    """The shard set every later step reads (shard's dest, then stage's)."""
    set_sha256: str | None = None
    """Its identity: the sha256 of its manifest.json (None for a set behind a URL: its spec is the identity)."""
    val: str | None = None
    val_sha256: str | None = None
    io_record: str | None = None
    ceiling: float | None = None
    """The compute ceiling (samples/s) the ceiling step measured."""
    tuned: str | None = None
    """The tuned config (tune's --out: [loader] and [layout])."""
    tuned_sha256: str | None = None
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)

    def identity(self) -> dict[str, Any]:
        return {"set": self.set, "set_sha256": self.set_sha256}

    def apply(self, output: dict[str, Any], run_dir: Path) -> None:
        """Take a step's output (its ``output`` function's, never run.json's)."""
        for key, value in output.items():
            if key in ("files",):
                continue
            if hasattr(self, key):
                setattr(self, key, value)
        if output.get("tuned"):
            check_no_link(run_dir, output["tuned"], "the tuned config")
            tuned = load_config(output["tuned"])
            self.loader, self.layout = tuned.loader, tuned.layout


@dataclass
class Context:
    cfg: Config
    run_dir: Path
    carry: Carry
    quiet: bool = False
    lines: Callable[[str], None] | None = None

    def folder(self, name: str) -> Path:
        return self.run_dir / name

    def record(self, name: str) -> Path:
        """The step's record: every step writes its folder's summary.json."""
        return self.folder(name) / SUMMARY


@dataclass(frozen=True)
class Outcome:
    """What ``execute`` returns: the record's path, whether its checks passed, and whether the run may go on."""

    record: Path
    ok: bool
    stop: bool = False


def check_no_link(run_dir: Path, path: str | Path | None, what: str) -> None:
    """DataError naming the link when ``path``, inside the run folder, is reached through a symbolic link (a link a
    job would write through, or read a file the run passes on from); a path outside the run folder is the user's
    (the jobs guard their own folders)."""
    if path is None or "://" in str(path) or str(path).startswith("pipe:") or not below(path, run_dir):
        return
    link = link_below(run_dir, path, what=what)
    if link is not None:
        raise DataError(f"{link} is a symbolic link in the run folder {run_dir}; gpufeed run never writes or reads "
                        f"{what} ({path}) through a link: remove it")


def manifest_sha256(spec: str | None, run_dir: Path | None = None) -> str | None:
    """A local set's identity: its manifest.json's sha256 (a folder or the manifest itself); None otherwise. A set
    in the run folder ``run_dir`` is read below it (no link: :func:`gpufeed.pipeline.state.file_sha256`)."""
    if spec is None or "://" in spec or spec.startswith("pipe:"):
        return None
    p = Path(spec)
    return file_sha256(p / "manifest.json" if p.is_dir() else p, run_dir)


def _inside(path: str, root: Path) -> bool:
    try:
        return Path(path).resolve().is_relative_to(root.resolve())
    except OSError:
        return False


def _set_output(ctx: Context, spec: str | None, key: str = "set") -> dict[str, Any]:
    """``{key: spec, key_sha256: its manifest's sha256 now}`` (read back from the set the step wrote)."""
    return {key: spec, f"{key}_sha256": manifest_sha256(spec, ctx.run_dir)}


def _set_files(spec: str | None, sha: str | None) -> dict[str, str]:
    if spec is None or sha is None:
        return {}
    p = Path(spec)
    return {str(p / "manifest.json" if p.is_dir() else p): sha}


def _drop(obj: Any, *names: str) -> dict[str, Any]:
    d = to_jsonable(obj)
    for n in names:
        d.pop(n, None)
    return d


# --------------------------------------------------------------------------- doctor


def prepare_doctor(ctx: Context) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    paths = [p for p in (ctx.carry.images, ctx.carry.set) if p and "://" not in p and Path(p).exists()]
    return paths, {"paths": paths, "loader": to_jsonable(ctx.cfg.loader)}, {}


def execute_doctor(ctx: Context, paths: Any, folder: Path, changed: bool) -> Outcome:
    from gpufeed.doctor import doctor

    record = doctor(paths, ctx.cfg.loader)
    path = write_json(folder / SUMMARY, record)
    return Outcome(path, bool(record.ok))


def no_output(ctx: Context, prepared: Any) -> dict[str, Any]:
    """The output of a step that passes nothing forward (doctor, verify, measure, train)."""
    return {}


def no_writes(prepared: Any) -> list[Any]:
    return []


# --------------------------------------------------------------------------- synth


def prepare_synth(ctx: Context) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    dest = ctx.cfg.synth.dest or str(ctx.folder("synth") / "images")
    synth = dataclasses.replace(ctx.cfg.synth, dest=dest)
    return synth, _drop(synth, "overwrite", "workers"), {}


def execute_synth(ctx: Context, synth: Any, folder: Path, changed: bool) -> Outcome:
    from gpufeed.synth import synthesize

    # the run's own folder is the run's to rewrite; a folder of the user's only with their [synth] overwrite
    overwrite = synth.overwrite or _inside(synth.dest, ctx.run_dir)
    record = synthesize(dataclasses.replace(synth, overwrite=overwrite))
    path = write_json(folder / SUMMARY, record)
    return Outcome(path, True)


def output_synth(ctx: Context, synth: Any) -> dict[str, Any]:
    return {"images": synth.dest}


def writes_synth(synth: Any) -> list[Any]:
    return [synth.dest]


# --------------------------------------------------------------------------- shard (+ val)


def prepare_shard(ctx: Context) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    cfg = ctx.cfg
    src = cfg.shard.src or ctx.carry.images
    if src is None:
        raise ConfigError("the shard step needs [shard] src (an image folder), or the synth step before it")
    train = dataclasses.replace(cfg.shard, src=src, dest=cfg.shard.dest or str(ctx.folder("shard") / "set"))
    val = None
    if cfg.shard_val is not None:  # [shard.val]: [shard]'s options over its own src (the loader merged them)
        val = dataclasses.replace(cfg.shard_val, dest=cfg.shard_val.dest or str(ctx.folder("shard") / "val"))
    options = {"train": _drop(train, "overwrite", "workers"), "val": val and _drop(val, "overwrite", "workers")}
    inputs = {"images": src}
    return (train, val), options, inputs


def execute_shard(ctx: Context, prepared: Any, folder: Path, changed: bool) -> Outcome:
    from gpufeed.shard import write_shards

    train, val = prepared
    records = {}
    for name, cfg in (("train", train), ("val", val)):
        if cfg is None:
            continue
        # a changed option is refused by shard unless overwrite: the run may overwrite what it wrote itself
        overwrite = cfg.overwrite or (changed and _inside(cfg.dest, ctx.run_dir))
        records[name] = write_shards(dataclasses.replace(cfg, overwrite=overwrite), progress=not ctx.quiet)
    path = write_json(folder / SUMMARY, records["train"])
    if "val" in records:
        write_json(folder / "val.json", records["val"])
    ok = all(bool(getattr(r, "ok", True)) for r in records.values())
    return Outcome(path, ok, stop=not ok)


def output_shard(ctx: Context, prepared: Any) -> dict[str, Any]:
    train, val = prepared
    out = _set_output(ctx, train.dest)
    if val is not None:
        out.update(_set_output(ctx, val.dest, "val"))
    out["files"] = {**_set_files(out["set"], out["set_sha256"]), **_set_files(out.get("val"), out.get("val_sha256"))}
    return out


def writes_shard(prepared: Any) -> list[Any]:
    return [cfg.dest for cfg in prepared if cfg is not None]


# --------------------------------------------------------------------------- verify


def prepare_verify(ctx: Context) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    sets = [s for s in (ctx.carry.set, ctx.carry.val) if s]
    options = {"sets": sets, "max_pixels": ctx.cfg.loader.max_pixels, "decode": True}
    return sets, options, {**ctx.carry.identity(), "val_sha256": ctx.carry.val_sha256}


def execute_verify(ctx: Context, sets: Any, folder: Path, changed: bool) -> Outcome:
    from gpufeed.verify import verify_shards

    ok, path = True, folder / SUMMARY
    for i, spec in enumerate(sets):
        record = verify_shards(spec, max_pixels=ctx.cfg.loader.max_pixels)
        written = write_json(folder / (SUMMARY if i == 0 else "val.json"), record)
        path = path if i else written
        ok = ok and bool(record.ok)
    return Outcome(path, ok, stop=not ok)  # a set that fails verify is not one to tune or train on


# --------------------------------------------------------------------------- io


def prepare_io(ctx: Context) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    io = dataclasses.replace(ctx.cfg.io, run_dir=str(ctx.folder("io")))
    return io, {"io": _drop(io), "paths": [ctx.carry.set]}, ctx.carry.identity()


def execute_io(ctx: Context, io: Any, folder: Path, changed: bool) -> Outcome:
    from gpufeed.storage import measure_io

    measure_io([ctx.carry.set], io, progress=ctx.lines)
    path = folder / SUMMARY
    return Outcome(path, bool(read_record(ctx, path).get("ok", True)))


def output_io(ctx: Context, io: Any) -> dict[str, Any]:
    return {"io_record": str(ctx.record("io"))}


def writes_io(io: Any) -> list[Any]:
    return [io.run_dir]


# --------------------------------------------------------------------------- stage


def prepare_stage(ctx: Context) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    if ctx.cfg.stage.dest is None:
        raise ConfigError("the stage step needs [stage] dest (the folder to copy the shard set to)")
    stage = dataclasses.replace(ctx.cfg.stage, src=ctx.carry.set)
    return stage, _drop(stage, "jobs"), ctx.carry.identity()


def execute_stage(ctx: Context, stage: Any, folder: Path, changed: bool) -> Outcome:
    from gpufeed.stage import stage as stage_set

    record = stage_set(stage, progress=not ctx.quiet)
    path = write_json(folder / SUMMARY, record)
    return Outcome(path, bool(record.ok), stop=not record.ok)


def output_stage(ctx: Context, stage: Any) -> dict[str, Any]:
    out = _set_output(ctx, stage.dest)
    return {**out, "files": _set_files(stage.dest, out["set_sha256"])}


def writes_stage(stage: Any) -> list[Any]:
    return [stage.dest]


# --------------------------------------------------------------------------- train modes


def _train_config(ctx: Context, mode: str, folder: Path, **extra: Any) -> TrainConfig:
    train = dataclasses.replace(ctx.cfg.train, shards=ctx.carry.set, mode=mode, run_dir=str(folder),
                                progress=ctx.cfg.train.progress and not ctx.quiet, **extra)
    if train.storage_record is None and ctx.carry.io_record is not None and mode != "synthetic":
        train = dataclasses.replace(train, storage_record=ctx.carry.io_record)
    return train


def _train_options(train: TrainConfig, loader: LoaderConfig, layout: LayoutConfig) -> dict[str, Any]:
    return {"train": _drop(train, "progress"), "loader": to_jsonable(loader), "layout": to_jsonable(layout)}


def _launch(train: TrainConfig, loader: LoaderConfig, layout: LayoutConfig) -> dict[str, Any]:
    from gpufeed.stage import stage_copy
    from gpufeed.train.launch import launch

    return launch(train, loader, layout, stager=stage_copy)


def prepare_ceiling(ctx: Context) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    train = _train_config(ctx, "synthetic", ctx.folder("ceiling"), val_shards=None, checkpoint_dir=None,
                          resume=False, steps=None)
    return train, _train_options(train, ctx.cfg.loader, ctx.cfg.layout), ctx.carry.identity()


def execute_ceiling(ctx: Context, train: Any, folder: Path, changed: bool) -> Outcome:
    _launch(train, ctx.cfg.loader, ctx.cfg.layout)
    return Outcome(folder / SUMMARY, True)


MAX_RATE = 1e12
"""A rate (samples/s) passed forward at most; a measured one is far below."""


def output_ceiling(ctx: Context, train: Any) -> dict[str, Any]:
    """The compute ceiling: the synthetic mode's samples/s, read back from the ceiling's record; None when the
    record holds no positive finite rate."""
    modes = read_record(ctx, ctx.record("ceiling")).get("modes")
    mode = modes.get("synthetic") if isinstance(modes, dict) else None
    rate = mode.get("samples_per_s") if isinstance(mode, dict) else None
    ok = isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0 < rate <= MAX_RATE
    return {"ceiling": float(rate) if ok else None}


def writes_train(train: Any) -> list[Any]:
    return [train.run_dir, train.checkpoint_dir]


def prepare_tune(ctx: Context) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    folder = ctx.folder("tune")
    tune = dataclasses.replace(ctx.cfg.tune_for_training(), shards=ctx.carry.set, run_dir=str(folder),
                               out=str(folder / "tuned.toml"))
    if tune.target_rate is None and ctx.carry.ceiling:
        tune = dataclasses.replace(tune, target_rate=float(ctx.carry.ceiling))
    options = {"tune": _drop(tune), "loader": to_jsonable(ctx.cfg.loader)}
    return tune, options, {**ctx.carry.identity(), "ceiling": ctx.carry.ceiling}


def execute_tune(ctx: Context, tune: Any, folder: Path, changed: bool) -> Outcome:
    from gpufeed.tune import tune as tune_loader

    tune_loader(tune, ctx.cfg.loader, progress=ctx.lines)
    return Outcome(folder / SUMMARY, True)


def output_tune(ctx: Context, tune: Any) -> dict[str, Any]:
    sha = file_sha256(tune.out, ctx.run_dir)
    return {"tuned": tune.out, "tuned_sha256": sha, "files": {tune.out: sha}}


def writes_tune(tune: Any) -> list[Any]:
    return [tune.run_dir, tune.out]


def _with_fix(train: TrainConfig) -> TrainConfig:
    """``train --measure --fix`` where TrainConfig has it (the closed loop that applies and re-measures fixes)."""
    if "fix" in {f.name for f in dataclasses.fields(TrainConfig)}:
        return dataclasses.replace(train, fix=True)  # type: ignore[call-arg]
    return train


def _train_inputs(ctx: Context) -> dict[str, Any]:
    c = ctx.carry
    return {**c.identity(), "tuned_sha256": c.tuned_sha256, "io_record_sha256": c.io_record and
            file_sha256(c.io_record, ctx.run_dir), "val_sha256": c.val_sha256}


def prepare_measure(ctx: Context) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    train = _with_fix(_train_config(ctx, "measure", ctx.folder("measure"), val_shards=None, checkpoint_dir=None,
                                    resume=False))
    return train, _train_options(train, ctx.carry.loader, ctx.carry.layout), _train_inputs(ctx)


def prepare_train(ctx: Context) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    train = _train_config(ctx, "real", ctx.folder("train"), val_shards=ctx.carry.val or ctx.cfg.train.val_shards)
    return train, _train_options(train, ctx.carry.loader, ctx.carry.layout), _train_inputs(ctx)


def execute_train(ctx: Context, train: Any, folder: Path, changed: bool) -> Outcome:
    record = _launch(train, ctx.carry.loader, ctx.carry.layout)
    return Outcome(folder / SUMMARY, bool(record.get("ok", True)))


def read_record(ctx: Context, path: Path) -> dict[str, Any]:
    """A step's record in the run folder ({} when it is missing or not an object), read below the run folder
    (no link, bounded: :func:`gpufeed.report.runfolder.read_json`)."""
    data = read_json(path, ctx.run_dir, "step record", MAX_RECORD_BYTES)
    return data if isinstance(data, dict) else {}


@dataclass(frozen=True)
class Step:
    name: str
    prepare: Callable[[Context], tuple[Any, dict[str, Any], dict[str, Any]]]
    execute: Callable[[Context, Any, Path, bool], Outcome]
    output: Callable[[Context, Any], dict[str, Any]] = no_output
    """What the step passes forward, from its prepared config and the files it wrote (run.json is only compared
    with it)."""
    writes: Callable[[Any], list[Any]] = no_writes
    """The paths its job writes besides its folder (each checked for a link when inside the run folder)."""
    feeds: bool = True
    """Whether later steps depend on it: a step that runs makes every later feeding step run too."""
    fresh_folder: bool = True
    """Whether its folder is emptied before it runs (False for steps whose job resumes from its own state)."""


STEP_TABLE: tuple[Step, ...] = (
    Step("doctor", prepare_doctor, execute_doctor, feeds=False),
    Step("synth", prepare_synth, execute_synth, output_synth, writes_synth, fresh_folder=False),
    Step("shard", prepare_shard, execute_shard, output_shard, writes_shard, fresh_folder=False),
    Step("verify", prepare_verify, execute_verify),
    Step("io", prepare_io, execute_io, output_io, writes_io),
    Step("stage", prepare_stage, execute_stage, output_stage, writes_stage, fresh_folder=False),
    Step("ceiling", prepare_ceiling, execute_ceiling, output_ceiling, writes_train),
    Step("tune", prepare_tune, execute_tune, output_tune, writes_tune),
    Step("measure", prepare_measure, execute_train, writes=writes_train),
    Step("train", prepare_train, execute_train, writes=writes_train),
)
"""Every step, in pipeline order (``config.STEPS``)."""
