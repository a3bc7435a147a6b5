"""The steps of ``gpufeed run``, one function pair each (docs/design.md §8): ``prepare`` resolves the step's job
config from the run's config and what earlier steps passed forward (``Carry``) and names its inputs' identities;
``execute`` calls the job's public entry function, writes the step's record in its folder and says what it passes
forward. No step reads another job's internals: what passes forward is read back from the records and files."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from gpufeed.config import Config, LayoutConfig, LoaderConfig, TrainConfig, load_config
from gpufeed.core.errors import ConfigError
from gpufeed.core.records import read_json_file, to_jsonable, write_json
from gpufeed.pipeline.state import MAX_RECORD_BYTES, file_sha256

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

    def apply(self, output: dict[str, Any]) -> None:
        """Take a step's output (fresh, or from run.json when the step is skipped)."""
        for key, value in output.items():
            if key in ("files",):
                continue
            if hasattr(self, key):
                setattr(self, key, value)
        if output.get("tuned"):
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


@dataclass(frozen=True)
class Outcome:
    """What ``execute`` returns: the record's path, whether its checks passed, whether the run may go on, and what
    passes forward (``files``: path -> sha256 that must still match for the step to count as done)."""

    record: Path
    ok: bool
    output: dict[str, Any]
    stop: bool = False


def manifest_sha256(spec: str | None) -> str | None:
    """A local set's identity: its manifest.json's sha256 (a folder or the manifest itself); None otherwise."""
    if spec is None or "://" in spec or spec.startswith("pipe:"):
        return None
    p = Path(spec)
    return file_sha256(p / "manifest.json" if p.is_dir() else p)


def _inside(path: str, root: Path) -> bool:
    try:
        return Path(path).resolve().is_relative_to(root.resolve())
    except OSError:
        return False


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
    return Outcome(path, bool(record.ok), {})


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
    return Outcome(path, True, {"images": synth.dest})


# --------------------------------------------------------------------------- shard (+ val)


def prepare_shard(ctx: Context) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    cfg, run = ctx.cfg, ctx.cfg.run
    src = cfg.shard.src or ctx.carry.images
    if src is None:
        raise ConfigError("the shard step needs [shard] src (an image folder), or the synth step before it")
    train = dataclasses.replace(cfg.shard, src=src, dest=cfg.shard.dest or str(ctx.folder("shard") / "set"))
    val = None
    if run.val_src is not None:
        val = dataclasses.replace(train, src=run.val_src, prefix="val",
                                  dest=run.val_dest or str(ctx.folder("shard") / "val"))
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
    out: dict[str, Any] = {"set": train.dest, "set_sha256": manifest_sha256(train.dest)}
    if val is not None:
        out.update(val=val.dest, val_sha256=manifest_sha256(val.dest))
    out["files"] = {**_set_files(out["set"], out["set_sha256"]), **_set_files(out.get("val"), out.get("val_sha256"))}
    ok = all(bool(getattr(r, "ok", True)) for r in records.values())
    return Outcome(path, ok, out, stop=not ok)


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
    return Outcome(path, ok, {}, stop=not ok)  # a set that fails verify is not one to tune or train on


# --------------------------------------------------------------------------- io


def prepare_io(ctx: Context) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    io = dataclasses.replace(ctx.cfg.io, run_dir=str(ctx.folder("io")))
    return io, {"io": _drop(io), "paths": [ctx.carry.set]}, ctx.carry.identity()


def execute_io(ctx: Context, io: Any, folder: Path, changed: bool) -> Outcome:
    from gpufeed.storage import measure_io

    measure_io([ctx.carry.set], io, progress=ctx.lines)
    path = folder / SUMMARY
    return Outcome(path, bool(read_record(path).get("ok", True)), {"io_record": str(path)})


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
    sha = manifest_sha256(stage.dest)
    return Outcome(path, bool(record.ok), {"set": stage.dest, "set_sha256": sha,
                                           "files": _set_files(stage.dest, sha)}, stop=not record.ok)


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
    record = _launch(train, ctx.cfg.loader, ctx.cfg.layout)
    mode = (record.get("modes") or {}).get("synthetic") or {}
    return Outcome(folder / SUMMARY, True, {"ceiling": mode.get("samples_per_s")})


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
    sha = file_sha256(tune.out)
    return Outcome(folder / SUMMARY, True, {"tuned": tune.out, "tuned_sha256": sha, "files": {tune.out: sha}})


def _with_fix(train: TrainConfig) -> TrainConfig:
    """``train --measure --fix`` where TrainConfig has it (the closed loop that applies and re-measures fixes)."""
    if "fix" in {f.name for f in dataclasses.fields(TrainConfig)}:
        return dataclasses.replace(train, fix=True)  # type: ignore[call-arg]
    return train


def _train_inputs(ctx: Context) -> dict[str, Any]:
    c = ctx.carry
    return {**c.identity(), "tuned_sha256": c.tuned_sha256, "io_record_sha256": c.io_record and
            file_sha256(c.io_record), "val_sha256": c.val_sha256}


def prepare_measure(ctx: Context) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    train = _with_fix(_train_config(ctx, "measure", ctx.folder("measure"), val_shards=None, checkpoint_dir=None,
                                    resume=False))
    return train, _train_options(train, ctx.carry.loader, ctx.carry.layout), _train_inputs(ctx)


def prepare_train(ctx: Context) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    train = _train_config(ctx, "real", ctx.folder("train"), val_shards=ctx.carry.val or ctx.cfg.train.val_shards)
    return train, _train_options(train, ctx.carry.loader, ctx.carry.layout), _train_inputs(ctx)


def execute_train(ctx: Context, train: Any, folder: Path, changed: bool) -> Outcome:
    record = _launch(train, ctx.carry.loader, ctx.carry.layout)
    return Outcome(folder / SUMMARY, bool(record.get("ok", True)), {})


def read_record(path: Path) -> dict[str, Any]:
    data = read_json_file(path, MAX_RECORD_BYTES, "step record")
    return data if isinstance(data, dict) else {}


@dataclass(frozen=True)
class Step:
    name: str
    prepare: Callable[[Context], tuple[Any, dict[str, Any], dict[str, Any]]]
    execute: Callable[[Context, Any, Path, bool], Outcome]
    feeds: bool = True
    """Whether later steps depend on it: a step that runs makes every later feeding step run too."""
    fresh_folder: bool = True
    """Whether its folder is emptied before it runs (False for steps whose job resumes from its own state)."""


STEP_TABLE: tuple[Step, ...] = (
    Step("doctor", prepare_doctor, execute_doctor, feeds=False),
    Step("synth", prepare_synth, execute_synth, fresh_folder=False),
    Step("shard", prepare_shard, execute_shard, fresh_folder=False),
    Step("verify", prepare_verify, execute_verify),
    Step("io", prepare_io, execute_io),
    Step("stage", prepare_stage, execute_stage, fresh_folder=False),
    Step("ceiling", prepare_ceiling, execute_ceiling),
    Step("tune", prepare_tune, execute_tune),
    Step("measure", prepare_measure, execute_train),
    Step("train", prepare_train, execute_train),
)
"""Every step, in pipeline order (``config.STEPS``)."""
