"""The table of ``gpufeed`` commands: each is a ``Job`` (name, parameters, entry function, renderer), and each entry
is a short function that calls one job with its own config section. See docs/design.md section 1.

An entry's docstring is its command's help. It imports its job module when it runs, so ``gpufeed --help`` imports
no job module (and no torch). The shell around it (``gpufeed.cli``) resolves the config, runs it and renders
the record.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import click

from gpufeed.cli.options import FieldArgument, FieldParam, field_option, field_options


@dataclass(frozen=True)
class Shell:
    """What an entry may take from the command line besides its config: --quiet, and where progress lines go
    (stderr, or None with --quiet)."""

    quiet: bool
    lines: Callable[[str], None] | None


@dataclass(frozen=True)
class Job:
    """One ``gpufeed NAME`` command: ``entry(conf, shell, **args)`` returns the record that ``render``
    ("module:function", imported once the job has run) turns into text. ``conf`` is the resolved config (file
    ``--config`` under the options that set config fields), or None with ``load`` False; ``args`` are the
    other parameters. Every command also takes --quiet and --json, and --config unless ``config`` is False."""

    name: str
    entry: Callable[..., Any]
    render: str
    params: tuple[click.Parameter, ...] = ()
    config: bool = True
    load: bool = True

    @property
    def sections(self) -> tuple[str, ...]:
        """The config sections the command's options and arguments set."""
        return tuple(sorted({p.section for p in self.params if isinstance(p, FieldParam)}))


def _index(conf: None, shell: Shell, shards: str, out: str | None, no_hash: bool, label: str,
           classes_file: str | None) -> Any:
    """Build the manifest for tar shards written by other tools (SHARDS: folder, glob or brace pattern; or a URL or
    pipe: brace pattern, with --out)."""
    from gpufeed.index import index_shards

    return index_shards(shards, out=out, hash=not no_hash, label=label, classes_file=classes_file)


def _shard(conf: Any, shell: Shell) -> Any:
    """Image folder SRC (one sub-folder per class) -> deterministic WebDataset shards + manifest in DEST
    (``gpufeed shard DEST --finish``: only the index and manifest of a set whose shards are complete)."""
    from gpufeed.shard import write_shards

    cfg = conf.shard
    if cfg.finish and cfg.dest is None:  # gpufeed shard DEST --finish: the one argument is DEST
        cfg = dataclasses.replace(cfg, src=None, dest=cfg.src)
    return write_shards(cfg, progress=not shell.quiet)


def _verify(conf: Any, shell: Shell, dest: str, decode: bool, workers: int | None, manifest: str | None) -> Any:
    """Re-read the shard set DEST (a folder, manifest.json, URL, brace pattern or pipe: command) against its
    manifest: sha256, counts, keys, labels, images. Exit 1 on a mismatch."""
    from gpufeed.verify import verify_shards

    return verify_shards(dest, decode=decode, workers=workers, max_pixels=conf.loader.max_pixels, manifest=manifest)


def _tune(conf: Any, shell: Shell) -> Any:
    """Measured, budget-aware DataLoader sweep over SHARDS -> the fastest per-rank [loader] config for this node.

    \b
    gpufeed tune SHARDS --nproc-per-node 8 --target-rate 24000 --out tuned.toml
    measures 8 concurrent rank loaders (the node's aggregate samples/s and the slowest rank's) and writes
    [loader] (per rank) and [layout] (the layout it was tuned for, which gpufeed train checks).
    """
    from gpufeed.tune import tune

    return tune(conf.tune_for_training(), conf.loader, progress=shell.lines)


def _synth(conf: Any, shell: Shell) -> Any:
    """Write an ImageNet-like ImageFolder of JPEGs to DEST (needs pip install 'gpufeed[synth]').

    Random crops of scikit-image's bundled photos, scaled to ImageNet-like sizes, flipped,
    colour-shifted and textured; JPEG quality 75-95, mean file ~115 KB.
    """
    from gpufeed.synth import synthesize

    return synthesize(conf.synth)


def _train(conf: Any, shell: Shell) -> Any:
    """AMP + DDP ResNet training that measures data stall and ends with a fed/starved verdict (exit 1 if starved).

    \b
    gpufeed train --shards DEST --measure                 compute ceiling, loader ceiling, real run, verdict
    gpufeed train --shards DEST --config tuned.toml --epochs 90 --nproc-per-node 8
    """
    from gpufeed.train.launch import launch

    train = dataclasses.replace(conf.train, progress=False) if shell.quiet else conf.train
    from gpufeed.stage import stage_copy  # train --fix stages with the stage job, which train may not import

    return launch(train, conf.loader, conf.layout, stager=stage_copy)


def _io(conf: Any, shell: Shell, paths: tuple[str, ...]) -> Any:
    """Read rate of each PATH (a shard set or an image folder), cold and warm, with 1, 2, 4, ... readers.

    \b
    gpufeed io /nvme/shards /dev/shm/shards --target-rate 3000
    measures both copies the same way, side by side, and says whether each delivers the MB/s that
    3000 samples/s need, and whether the set fits in the page cache and in /dev/shm.
    """
    from gpufeed.storage import measure_io

    return measure_io(list(paths), conf.io, progress=shell.lines)


def _stage(conf: Any, shell: Shell) -> Any:
    """Copy the shard set SRC (folder or manifest.json) to the local folder DEST: free-space check, parallel
    copies to temporary names, sha256 checked against the manifest, resumable; DEST gets its own manifest."""
    from gpufeed.stage import stage

    return stage(conf.stage, progress=not shell.quiet)


def _doctor(conf: Any, shell: Shell, paths: tuple[str, ...]) -> Any:
    """Check this machine for training: versions, CUDA driver, GPUs (PCIe link, throttling, ECC), usable cores,
    RAM, /dev/shm against what the [loader] needs, open-file limit, and each DATA_PATH (filesystem, network or
    local, whether its shard set fits the page cache). Exit 1 when a check fails; a machine without a GPU is ok.
    """
    from gpufeed.doctor import doctor

    return doctor(list(paths), conf.loader)


def _plan(conf: Any, shell: Shell) -> Any:
    """Measure real training steps at small batch sizes, model the peak memory as linear in the batch size, check
    it at a third batch, and say whether --batch-size fits the GPU memory (largest batch that does) and how many
    loader cores per GPU the target rate needs (with --record). Exit 1 when the batch does not fit or the cores
    are too few.

    \b
    gpufeed plan --arch resnet50 --batch-size 256 --amp bf16 --channels-last --gpu-memory 80GiB
    """
    from gpufeed.memplan import plan

    return plan(conf.plan)


def _config(conf: None, shell: Shell, defaults: bool, config_path: str | None) -> Any:
    """Print a configuration as commented TOML, every section and key: the built-in defaults (--defaults), or
    FILE resolved over them (--config FILE; exit 2 when FILE has an error). Generated from the config classes,
    so it is always the installed version's.

    \b
    gpufeed config --defaults > my.toml     a starting point: edit it, then gpufeed CMD --config my.toml
    """
    from gpufeed.config import load_config
    from gpufeed.core.errors import ConfigError

    if defaults == (config_path is not None):
        raise ConfigError("give --defaults or --config FILE (one of them)")
    return load_config(config_path)


def _run(conf: None, shell: Shell, config_file: str, run_dir: str | None, report: bool) -> Any:
    """Run the whole job from one config: doctor -> shard (+val) -> verify -> io (-> stage) -> ceiling -> tune ->
    train --measure (-> full training), as [run] steps says, in one run folder, then write its report.

    \b
    gpufeed run configs/demo.toml        the demo: synthesize, shard, tune and measure on the CPU
    Each step is skipped when run.json says it finished with the same options and inputs and its output is
    intact, so a run stopped by Ctrl-C or kill -9 continues where it stopped; a changed option re-runs that
    step and every step after it. Exit 1 when a step's check failed (a verify mismatch, a starved verdict).
    """
    from gpufeed.pipeline import run_pipeline

    return run_pipeline(config_file, run_dir=run_dir, quiet=shell.quiet, lines=shell.lines, report=report)


def _report(conf: None, shell: Shell, folder: str) -> Any:
    """Write report.html (self-contained: inline SVG charts, no network) and its Markdown for FOLDER: a gpufeed
    run folder, or a single tune or train run folder. The verdict at the top is copied from the train record."""
    from gpufeed.report import report

    return report(folder)


_MODES = (  # flags that each pick one value of [train] mode, with help of their own
    field_option("train", "mode", "--synthetic", flag_value="synthetic", default=None,
                 help="Fixed batch already on the device: the compute ceiling (of the GPU, or of the CPU without one)."),
    field_option("train", "mode", "--loader-only", flag_value="loader-only",
                 help="Loader alone, batches moved to the device and dropped."),
    field_option("train", "mode", "--measure", flag_value="measure",
                 help="Run synthetic, loader-only and real briefly, in that order, then the verdict."),
)

COMMANDS: tuple[Job, ...] = (
    Job("index", _index, "gpufeed.index:render", config=False, load=False, params=(
        click.Argument(["shards"]),
        click.Option(["--out"], type=click.Path(file_okay=False),
                     help="Folder for manifest.json  [default: the shard folder; required for URL and pipe: "
                          "patterns]."),
        click.Option(["--no-hash"], is_flag=True,
                     help="Skip the sha256 of each shard (faster; verify then checks sizes only)."),
        click.Option(["--label", "label"], default="cls", show_default=True, metavar="cls|txt|json:FIELD",
                     help="Where each sample's label is: the .cls member, the .txt member, or FIELD of the .json "
                          "member (an integer is a class index, a string a class name)."),
        click.Option(["--classes", "classes_file"], type=click.Path(dir_okay=False),
                     help="Class names in label order, one per line  [default: classes.txt next to the shards, "
                          "else the sorted distinct labels]."))),
    Job("shard", _shard, "gpufeed.shard:render_shard", params=(
        FieldArgument("shard", "src"), FieldArgument("shard", "dest", required=False),
        *field_options("shard", "workers", "seed", "shard_samples", "shard_bytes", "multiple_of", "prefix",
                       "max_size", "quality", "check", "strict", "overwrite", "allow_empty_classes", "max_pixels",
                       "classes_like", "classes_file", "engine", "ray_address", "num_nodes", "node_rank"),
        field_option("shard", "finish", switch=False))),
    Job("verify", _verify, "gpufeed.verify:render_verify", params=(
        click.Argument(["dest"], type=click.Path()),
        click.Option(["--decode/--no-decode"], default=True, show_default=True, help="Decode every image."),
        click.Option(["--workers"], type=int, help="Worker processes  [default: the CPUs this process may use]."),
        field_option("loader", "max_pixels"),
        click.Option(["--manifest", "manifest"], type=str,
                     help="The set's manifest.json (a path or URL) when DEST is a brace pattern or pipe: command  "
                          "[default: the manifest.json next to DEST]."))),
    Job("tune", _tune, "gpufeed.tune:render", params=(
        FieldArgument("tune", "shards"),
        *field_options("tune", "manifest", "budget_s", "batch_size", "image_size", "max_workers", "cpu_budget",
                       "ram_budget", "target_rate", "baseline_imagefolder", "out", "run_dir", "repeats", "window_s",
                       "device", "nproc_per_node", "trainer_cores", "with_model", "model_threads", "storage_probe_s"))),
    Job("synth", _synth, "gpufeed.synth:render_synth", params=(
        FieldArgument("synth", "dest"), *field_options("synth", "images", "classes", "seed", "workers"),
        field_option("synth", "overwrite", switch=False))),
    Job("train", _train, "gpufeed.train.report:render", params=(
        *field_options("train", "shards", "val_shards", "manifest", "arch", "epochs", "steps", "batch_size",
                       "accum_steps", "image_size", "amp", "channels_last", "compile", "lr", "warmup_steps",
                       "momentum", "weight_decay", "label_smoothing", "checkpoint_dir", "checkpoint_every", "resume",
                       "resume_other_set", "seed"),
        *_MODES, *field_options("train", "measure_steps", "measure_seconds", "profile_steps", "log_every"),
        field_option("loader", "num_workers"),
        *field_options("train", "nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port",
                       "rdzv_endpoint", "rdzv_id", "device", "threads", "storage_bytes_per_s", "storage_record",
                       "storage_probe_s", "fix", "fix_budget_s", "fix_stage_dir", "run_dir"))),
    Job("io", _io, "gpufeed.storage:render", params=(
        click.Argument(["paths"], nargs=-1, required=True, type=click.Path()),
        *field_options("io", "seconds", "bytes", "max_readers", "max_files", "target_rate", "gpu_ceiling",
                       "run_dir"))),
    Job("stage", _stage, "gpufeed.stage:render_stage", params=(
        FieldArgument("stage", "src", type=click.Path()), FieldArgument("stage", "dest"),
        *field_options("stage", "jobs", "node_rank", "num_nodes"))),
    Job("doctor", _doctor, "gpufeed.doctor:render", params=(
        click.Argument(["paths"], nargs=-1, type=click.Path()),
        *field_options("loader", "num_workers", "prefetch_factor", "batch_size", "image_size"))),
    Job("plan", _plan, "gpufeed.memplan:render", params=(
        *field_options("plan", "arch", "num_classes", "batch_size", "image_size", "amp", "channels_last",
                       "optimizer", "device"),
        field_option("plan", "measure_batches", nargs=2, metavar="B1 B2"),
        *field_options("plan", "check_batch", "gpu_memory", "headroom", "target_rate", "record", "gpus",
                       "trainer_cores"))),
    Job("config", _config, "gpufeed.config:render_config", load=False, params=(
        click.Option(["--defaults"], is_flag=True, help="Print the built-in defaults (what configs/default.toml holds)."),
    )),
    Job("run", _run, "gpufeed.pipeline:render", config=False, load=False, params=(
        click.Argument(["config_file"], type=click.Path(dir_okay=False)),
        click.Option(["--run-dir", "run_dir"], type=click.Path(file_okay=False),
                     help="The run folder  [default: [run] dir, else runs/NAME for CONFIG_FILE NAME.toml]."),
        click.Option(["--report/--no-report"], default=True, show_default=True,
                     help="Write report.html and report.md in the run folder at the end."))),
    Job("report", _report, "gpufeed.report:render", config=False, load=False, params=(
        click.Argument(["folder"], type=click.Path(file_okay=False)),)),
)
"""Every ``gpufeed`` command, in the order they were added; ``gpufeed --help`` lists them sorted."""
