"""The ``gpufeed`` command: a thin Click shell around library calls.

Every command parses options, resolves its config (CLI > file > defaults), calls one job function
and renders the record it returns. Heavy imports (torch, PIL, webdataset) happen inside commands,
so ``gpufeed --help`` stays fast. Exit codes: 0 ok, 1 the job ran but a check failed, 2 usage or
input error (one sentence, no traceback). With ``--json`` stdout carries exactly one JSON object,
the command's summary record, or on an error ``{"error": sentence, "exit_code": N, "command": name}``; human
text goes to stderr. ``--quiet`` (on every command, or before it) turns progress and notes off.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable

import click

from gpufeed.config import (IoConfig, LoaderConfig, PlanConfig, ShardConfig, StageConfig, SynthConfig, TrainConfig,
                            TuneConfig, field_help)
from gpufeed.core.errors import GpufeedError


def config_help(cls: type, *names: str, **elsewhere: type) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give every option declared below it that sets a field of config class ``cls`` that field's help: its
    docstring, default and range (``config.field_help``), so each default is written once, in config.py. The
    help is written when it is shown (``_Command``).

    An option sets the field named as its parameter (less a trailing ``_``: ``compile_`` -> ``compile``);
    ``names``, when given, limits this to those fields; ``elsewhere`` maps a parameter to the config class that
    holds its field instead (train's ``num_workers`` sets ``LoaderConfig.num_workers``). Options with help of
    their own, and flags that each pick one value of a field (``--synthetic``), keep theirs.
    """
    fields = {f.name for f in dataclasses.fields(cls) if not names or f.name in names}

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        for param in getattr(f, "__click_params__", []):
            if not isinstance(param, click.Option) or param.help is not None or not param.name:
                continue
            if param.is_flag and not param.is_bool_flag:
                continue
            name = param.name.rstrip("_")
            if name in elsewhere:
                param._gpufeed_field = (elsewhere[name], name)  # type: ignore[attr-defined]
            elif name in fields:
                param._gpufeed_field = (cls, name)  # type: ignore[attr-defined]
        return f

    return decorate


class _Command(click.Command):
    """A command whose options' help from config fields (``config_help``) is written when help is shown: that
    reads config.py's source (~20 ms), which a command that runs should not pay."""

    def _write_help(self) -> None:
        for param in self.params:
            field = getattr(param, "_gpufeed_field", None)
            if field is not None and param.help is None:
                param.help = field_help(*field)

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        self._write_help()
        super().format_help(ctx, formatter)

    def shell_complete(self, ctx: click.Context, incomplete: str) -> list[Any]:
        self._write_help()  # completions of options show their help
        return super().shell_complete(ctx, incomplete)

    def to_info_dict(self, ctx: click.Context) -> dict[str, Any]:
        self._write_help()
        return super().to_info_dict(ctx)


def config_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--config", "config_path", type=click.Path(exists=True, dir_okay=False),
        help="TOML config file (configs/*.toml); CLI options override it.",
    )(f)


_JSON = "gpufeed.json"
_QUIET = "gpufeed.quiet"
"""Keys of ``click.Context.meta`` (shared by the group's and the command's context): --json and --quiet given."""


def _remember(key: str) -> Callable[[click.Context, click.Parameter, Any], Any]:
    def callback(ctx: click.Context, _param: click.Parameter, value: Any) -> Any:
        if value:
            ctx.meta[key] = True
        return value

    return callback


def json_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--json", "as_json", is_flag=True, callback=_remember(_JSON),
        help="Print exactly one JSON object (the summary record, or {\"error\": ..., \"exit_code\": ...}) on stdout; "
             "human text goes to stderr.",
    )(f)


def quiet_option(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--quiet`` on a command (also ``gpufeed --quiet CMD``): read with :func:`is_quiet`."""
    return click.option("--quiet", is_flag=True, expose_value=False, callback=_remember(_QUIET),
                        help="No progress bars or notes (errors, the result and the --json record stay).")(f)


def is_quiet() -> bool:
    """``--quiet`` was given (on the command or the group). Progress bars are also off when stderr is not a
    terminal (``gpufeed.core.progress``)."""
    ctx = click.get_current_context(silent=True)
    return bool(ctx is not None and ctx.meta.get(_QUIET))


def progress_lines() -> Callable[[str], None] | None:
    """The progress callback of a job that reports in lines (tune's trials, io's steps): each line on stderr, or
    None with --quiet (decided here, in the command's thread)."""
    return None if is_quiet() else lambda line: say(line, err=True)


def json_error(message: str, exit_code: int, command: str | None = None) -> None:
    """Under ``--json``, the error as the one JSON object on stdout (the sentence still goes to stderr)."""
    ctx = click.get_current_context(silent=True)
    if ctx is None or not ctx.meta.get(_JSON):
        return
    from gpufeed.core.records import dumps

    name = command or (ctx.info_name if ctx.parent is not None else None)
    click.echo(dumps({"error": message, "exit_code": exit_code, "command": name}, indent=None))


def _verbose() -> bool:
    import os

    return os.environ.get("GPUFEED_VERBOSE", "") not in ("", "0")


def say(text: str, err: bool = False) -> None:
    """THE way text reaches the terminal: ``click.echo`` of ``text`` with the password of every URL in it hidden
    (:func:`gpufeed.core.redact.redact`)."""
    from gpufeed.core.redact import redact

    click.echo(redact(text), err=err)


def fail(message: str, exit_code: int) -> None:
    """One sentence on stderr, then exit (with ``--verbose`` the active traceback is printed first); passwords in
    URLs hidden in both."""
    if _verbose():
        import traceback

        say(traceback.format_exc().rstrip("\n"), err=True)
    say(f"error: {message}", err=True)
    json_error(message, exit_code)
    sys.exit(exit_code)


def run_job(job: Callable[[], Any], render: Callable[[Any], str], as_json: bool) -> None:
    """Call ``job``, render its record, and exit 0, or 1 when the record says a check failed.

    A record signals a failed check with a false ``ok`` attribute (or key). Errors are one sentence:
    a GpufeedError exits with its ``exit_code`` (2 input/usage, 1 a started run failed), an OSError with 2,
    anything else (a bug) with 1; tracebacks only with ``gpufeed --verbose``.
    """
    from gpufeed.core.errors import one_line

    try:
        record = job()
    except GpufeedError as exc:
        fail(one_line(exc), exc.exit_code)
    except OSError as exc:  # a path that is not a folder, no permission, a full disk: the user's to fix
        where = f" ({exc.filename})" if exc.filename else ""
        fail(f"{exc.strerror or exc}{where}", 2)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        json_error("interrupted", 130)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - a bug: still one sentence unless --verbose
        fail(f"unexpected {type(exc).__name__}: {one_line(exc)} (rerun with gpufeed --verbose for the traceback)", 1)
    human = render(record)
    if as_json:
        from gpufeed.core.records import dumps

        if human and not is_quiet():
            say(human, err=True)
        click.echo(dumps(record, indent=None))
    elif human:
        say(human)
    ok = record.get("ok", True) if isinstance(record, dict) else getattr(record, "ok", True)
    sys.exit(0 if ok else 1)


def load(config_path: str | None, section: str, overrides: dict[str, Any]) -> Any:
    """Resolve one section of the config (CLI > file > defaults) or fail with exit code 2."""
    from gpufeed.config import load_config

    try:
        cfg = load_config(config_path, {f"{section}.{k}": v for k, v in overrides.items()})
    except GpufeedError as exc:
        fail(str(exc), exc.exit_code)
    return getattr(cfg, section)


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """``--version``, as ``click.version_option`` prints it; the version is looked up only then."""
    if not value or ctx.resilient_parsing:
        return
    import gpufeed

    click.echo(f"gpufeed, version {gpufeed.__version__}")
    ctx.exit()


class _Group(click.Group):
    """The ``gpufeed`` group: a usage error Click finds (an unknown option, a bad value) under ``--json`` also
    prints the one JSON error object on stdout; Click still prints its usage text on stderr and exits 2."""

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        argv = list(args)
        try:
            ctx = super().make_context(info_name, args, parent=parent, **extra)
        except click.ClickException as exc:
            self._json_usage_error(exc, argv)
            raise
        ctx.meta["gpufeed.argv"] = argv
        return ctx

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.ClickException as exc:
            self._json_usage_error(exc, ctx.meta.get("gpufeed.argv", []))
            raise

    def _json_usage_error(self, exc: click.ClickException, argv: list[str]) -> None:
        words = argv[:argv.index("--")] if "--" in argv else argv
        if "--json" not in words:
            return
        from gpufeed.core.records import dumps

        command = next((w for w in words if w in self.commands), None)
        click.echo(dumps({"error": exc.format_message(), "exit_code": exc.exit_code, "command": command},
                         indent=None))


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Show the version and exit.")
@click.option("--verbose", "-v", is_flag=True, help="Print tracebacks with errors (also GPUFEED_VERBOSE=1).")
@quiet_option
def cli(verbose: bool) -> None:
    """Keep GPUs fed: image folder -> WebDataset shards -> tuned loader -> measured training.

    \b
    gpufeed synth   DEST           make a small ImageNet-like image folder (demo, tests, benchmarks)
    gpufeed shard   SRC DEST       image folder -> deterministic, verified WebDataset shards
    gpufeed verify  DEST           re-read a shard set against its manifest
    gpufeed index   SHARDS         build the manifest for shards written by other tools
    gpufeed tune    SHARDS         measured DataLoader sweep -> [loader] config
    gpufeed train   --shards DEST  AMP + DDP ResNet run with a fed/starved verdict
    gpufeed io      PATH ...       read rate of shard sets / image folders, cold and warm
    gpufeed stage   SRC DEST       copy a shard set to NVMe or /dev/shm, checked and resumable
    gpufeed doctor  [DATA_PATH ...] check drivers, GPUs, CPUs, /dev/shm and data paths: ok / warn / fail
    gpufeed plan    --arch resnet50 will the batch fit in GPU memory; loader cores per GPU
    gpufeed config  --defaults     print the default configuration (TOML)

    Progress bars are drawn only when stderr is a terminal (GPUFEED_PROGRESS=1 forces them on, 0 off).
    Shell completion: eval "$(_GPUFEED_COMPLETE=bash_source gpufeed)" (zsh_source, fish_source).
    """
    if verbose:
        import os

        os.environ["GPUFEED_VERBOSE"] = "1"  # torchrun ranks inherit it


cli.command_class = _Command  # every command below: help from config fields, written lazily


# Commands are added below, one per job; each imports its job module inside the function.


@cli.command("index")
@click.argument("shards")
@click.option("--out", type=click.Path(file_okay=False),
              help="Folder for manifest.json  [default: the shard folder; required for URL and pipe: patterns].")
@click.option("--no-hash", is_flag=True, help="Skip the sha256 of each shard (faster; verify then checks sizes only).")
@click.option("--label", "label", default="cls", show_default=True, metavar="cls|txt|json:FIELD",
              help="Where each sample's label is: the .cls member, the .txt member, or FIELD of the .json member "
                   "(an integer is a class index, a string a class name).")
@click.option("--classes", "classes_file", type=click.Path(dir_okay=False),
              help="Class names in label order, one per line  [default: classes.txt next to the shards, else the "
                   "sorted distinct labels].")
@quiet_option
@json_option
def index_cmd(shards: str, out: str | None, no_hash: bool, label: str, classes_file: str | None,
              as_json: bool) -> None:
    """Build the manifest for tar shards written by other tools (SHARDS: folder, glob or brace pattern; or a URL or
    pipe: brace pattern, with --out)."""
    from gpufeed.index import index_shards, render

    run_job(lambda: index_shards(shards, out=out, hash=not no_hash, label=label, classes_file=classes_file), render,
            as_json)


@cli.command()
@config_help(ShardConfig)
@click.argument("src", type=click.Path(file_okay=False))
@click.argument("dest", type=click.Path(file_okay=False), required=False)
@click.option("--workers", type=int)
@click.option("--seed", type=int)
@click.option("--shard-samples", type=int)
@click.option("--shard-bytes", type=str)
@click.option("--multiple-of", type=int)
@click.option("--prefix", type=str)
@click.option("--max-size", type=int)
@click.option("--quality", type=int)
@click.option("--check", type=click.Choice(["full", "header"]))
@click.option("--strict/--no-strict", default=None)
@click.option("--overwrite/--no-overwrite", default=None)
@click.option("--allow-empty-classes/--no-allow-empty-classes", default=None)
@click.option("--max-pixels", type=int)
@click.option("--classes-like", type=click.Choice(["gpufeed", "imagefolder"]))
@click.option("--classes", "classes_file", type=click.Path(dir_okay=False))
@click.option("--engine", type=click.Choice(["local", "ray"]))
@click.option("--ray-address", type=str)
@click.option("--num-nodes", type=int)
@click.option("--node-rank", type=int)
@click.option("--finish", is_flag=True, default=None)
@quiet_option
@config_option
@json_option
def shard(src: str, dest: str, workers: int | None, seed: int | None, shard_samples: int | None,
          shard_bytes: str | None, multiple_of: int | None, prefix: str | None, max_size: int | None,
          quality: int | None, check: str | None, strict: bool | None, overwrite: bool | None,
          allow_empty_classes: bool | None, max_pixels: int | None, classes_like: str | None,
          classes_file: str | None, engine: str | None, ray_address: str | None, num_nodes: int | None,
          node_rank: int | None, finish: bool | None, config_path: str | None, as_json: bool) -> None:
    """Image folder SRC (one sub-folder per class) -> deterministic WebDataset shards + manifest in DEST
    (``gpufeed shard DEST --finish``: only the index and manifest of a set whose shards are complete)."""
    src, dest = (None, src) if finish and dest is None else (src, dest)
    cfg = load(config_path, "shard", {
        "src": src, "dest": dest, "workers": workers, "seed": seed, "shard_samples": shard_samples,
        "shard_bytes": shard_bytes, "multiple_of": multiple_of, "prefix": prefix, "max_size": max_size,
        "quality": quality, "check": check, "strict": strict, "overwrite": overwrite,
        "allow_empty_classes": allow_empty_classes, "max_pixels": max_pixels, "classes_like": classes_like,
        "classes_file": classes_file, "engine": engine, "ray_address": ray_address, "num_nodes": num_nodes,
        "node_rank": node_rank, "finish": finish})

    def job() -> Any:
        from gpufeed.shard import write_shards

        return write_shards(cfg, progress=not is_quiet())

    def render(report: Any) -> str:
        from gpufeed.shard import render_shard

        return render_shard(report)

    run_job(job, render, as_json)


@cli.command()
@config_help(LoaderConfig, "max_pixels")
@click.argument("dest", type=click.Path())
@click.option("--decode/--no-decode", default=True, show_default=True, help="Decode every image.")
@click.option("--workers", type=int, help="Worker processes  [default: the CPUs this process may use].")
@click.option("--max-pixels", type=int)
@click.option("--manifest", "manifest", type=str,
              help="The set's manifest.json (a path or URL) when DEST is a brace pattern or pipe: command  "
                   "[default: the manifest.json next to DEST].")
@quiet_option
@config_option
@json_option
def verify(dest: str, decode: bool, workers: int | None, max_pixels: int | None, manifest: str | None,
           config_path: str | None, as_json: bool) -> None:
    """Re-read the shard set DEST (a folder, manifest.json, URL, brace pattern or pipe: command) against its
    manifest: sha256, counts, keys, labels, images. Exit 1 on a mismatch."""
    loader = load(config_path, "loader", {"max_pixels": max_pixels})

    def job() -> Any:
        from gpufeed.verify import verify_shards

        return verify_shards(dest, decode=decode, workers=workers, max_pixels=loader.max_pixels, manifest=manifest)

    def render(report: Any) -> str:
        from gpufeed.verify import render_verify

        return render_verify(report)

    run_job(job, render, as_json)


@cli.command()
@config_help(TuneConfig)
@click.argument("shards", type=click.Path())
@click.option("--manifest", type=str)
@click.option("--budget", "budget_s", type=float)
@click.option("--batch-size", type=int)
@click.option("--image-size", type=int)
@click.option("--max-workers", type=int)
@click.option("--cpu-budget", type=float)
@click.option("--ram-budget", type=str)
@click.option("--target-rate", type=float)
@click.option("--baseline-imagefolder", type=click.Path(file_okay=False))
@click.option("--out", type=click.Path(dir_okay=False))
@click.option("--run-dir", type=click.Path(file_okay=False))
@click.option("--repeats", type=int)
@click.option("--window", "window_s", type=float)
@click.option("--device", type=str)
@click.option("--nproc-per-node", type=int)
@click.option("--trainer-cores", type=int)
@click.option("--storage-probe-s", type=float)
@quiet_option
@config_option
@json_option
def tune(shards: str, manifest: str | None, budget_s: float | None, batch_size: int | None,
         image_size: int | None, max_workers: int | None, cpu_budget: float | None, ram_budget: str | None,
         target_rate: float | None, baseline_imagefolder: str | None, out: str | None, run_dir: str | None,
         repeats: int | None, window_s: float | None, device: str | None, nproc_per_node: int | None,
         trainer_cores: int | None, storage_probe_s: float | None, config_path: str | None, as_json: bool) -> None:
    """Measured, budget-aware DataLoader sweep over SHARDS -> the fastest per-rank [loader] config for this node.

    \b
    gpufeed tune SHARDS --nproc-per-node 8 --target-rate 24000 --out tuned.toml
    measures 8 concurrent rank loaders (the node's aggregate samples/s and the slowest rank's) and writes
    [loader] (per rank) and [layout] (the layout it was tuned for, which gpufeed train checks).
    """
    cfg = load(config_path, "tune", {
        "shards": shards, "manifest": manifest, "budget_s": budget_s, "batch_size": batch_size,
        "image_size": image_size, "max_workers": max_workers, "cpu_budget": cpu_budget, "ram_budget": ram_budget,
        "target_rate": target_rate, "baseline_imagefolder": baseline_imagefolder, "out": out, "run_dir": run_dir,
        "repeats": repeats, "window_s": window_s, "device": device, "nproc_per_node": nproc_per_node,
        "trainer_cores": trainer_cores, "storage_probe_s": storage_probe_s})
    if cfg.nproc_per_node is None:  # the layout training will run: [train] nproc_per_node
        cfg = dataclasses.replace(cfg, nproc_per_node=load(config_path, "train", {}).nproc_per_node)
    base = load(config_path, "loader", {})

    def job() -> Any:
        from gpufeed.tune import tune as run_tune

        return run_tune(cfg, base, progress=progress_lines())

    def render(report: Any) -> str:
        from gpufeed.tune import render as render_tune

        return render_tune(report)

    run_job(job, render, as_json)


@cli.command()
@config_help(SynthConfig)
@click.argument("dest", type=click.Path(file_okay=False))
@click.option("--images", type=int)
@click.option("--classes", type=int)
@click.option("--seed", type=int)
@click.option("--workers", type=int)
@click.option("--overwrite", is_flag=True, default=None)
@quiet_option
@config_option
@json_option
def synth(dest: str, images: int | None, classes: int | None, seed: int | None, workers: int | None,
          overwrite: bool | None, config_path: str | None, as_json: bool) -> None:
    """Write an ImageNet-like ImageFolder of JPEGs to DEST (needs pip install 'gpufeed[synth]').

    Random crops of scikit-image's bundled photos, scaled to ImageNet-like sizes, flipped,
    colour-shifted and textured; JPEG quality 75-95, mean file ~115 KB.
    """
    cfg = load(config_path, "synth", {"dest": dest, "images": images, "classes": classes, "seed": seed,
                                      "workers": workers, "overwrite": overwrite})

    def job() -> Any:
        from gpufeed.synth import synthesize

        return synthesize(cfg)

    def render(report: Any) -> str:
        from gpufeed.synth import render_synth

        return render_synth(report)

    run_job(job, render, as_json)


@cli.command()
@config_help(TrainConfig, num_workers=LoaderConfig)
@click.option("--shards", type=click.Path())
@click.option("--val-shards", type=click.Path())
@click.option("--manifest", type=str)
@click.option("--arch", type=click.Choice(["resnet18", "resnet34", "resnet50", "resnet101"]))
@click.option("--epochs", type=int)
@click.option("--steps", type=int)
@click.option("--batch-size", type=int)
@click.option("--accum-steps", type=int)
@click.option("--image-size", type=int)
@click.option("--amp", type=click.Choice(["auto", "bf16", "fp16", "off"]))
@click.option("--channels-last/--no-channels-last", default=None)
@click.option("--compile/--no-compile", "compile_", default=None)
@click.option("--lr", type=float)
@click.option("--warmup-steps", type=int)
@click.option("--momentum", type=float)
@click.option("--weight-decay", type=float)
@click.option("--label-smoothing", type=float)
@click.option("--checkpoint-dir", type=click.Path(file_okay=False))
@click.option("--checkpoint-every", type=int)
@click.option("--resume/--no-resume", default=None)
@click.option("--resume-other-set/--no-resume-other-set", default=None)
@click.option("--seed", type=int)
@click.option("--synthetic", "mode", flag_value="synthetic", default=None,
              help="Fixed batch already on the device: the compute ceiling (of the GPU, or of the CPU without one).")
@click.option("--loader-only", "mode", flag_value="loader-only", help="Loader alone, batches moved to the device and dropped.")
@click.option("--measure", "mode", flag_value="measure",
              help="Run synthetic, loader-only and real briefly, in that order, then the verdict.")
@click.option("--measure-steps", type=int)
@click.option("--log-every", type=int)
@click.option("--num-workers", type=int)
@click.option("--nproc-per-node", type=int)
@click.option("--nnodes", type=str)
@click.option("--node-rank", type=int)
@click.option("--master-addr", type=str)
@click.option("--master-port", type=int)
@click.option("--rdzv-endpoint", type=str)
@click.option("--rdzv-id", type=str)
@click.option("--device", type=str)
@click.option("--threads", type=int)
@click.option("--storage-rate", "storage_bytes_per_s", type=float)
@click.option("--storage-record", type=click.Path(dir_okay=False))
@click.option("--storage-probe-s", type=float)
@click.option("--run-dir", type=click.Path(file_okay=False))
@quiet_option
@config_option
@json_option
def train(config_path: str | None, as_json: bool, num_workers: int | None, compile_: bool | None,
          **opts: Any) -> None:
    """AMP + DDP ResNet training that measures data stall and ends with a fed/starved verdict (exit 1 if starved).

    \b
    gpufeed train --shards DEST --measure                 compute ceiling, loader ceiling, real run, verdict
    gpufeed train --shards DEST --config tuned.toml --epochs 90 --nproc-per-node 8
    """
    from gpufeed.config import load_config

    overrides = {f"train.{k}": v for k, v in opts.items()}
    overrides["train.compile"] = compile_
    overrides["train.progress"] = False if is_quiet() else None
    overrides["loader.num_workers"] = num_workers
    try:
        conf = load_config(config_path, overrides)
    except GpufeedError as exc:
        from gpufeed.core.errors import one_line

        fail(one_line(exc), exc.exit_code)

    def job() -> Any:
        from gpufeed.train.launch import launch

        return launch(conf.train, conf.loader, conf.layout)

    from gpufeed.train.report import render

    run_job(job, render, as_json)


@cli.command("io")
@config_help(IoConfig)
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("--seconds", type=float)
@click.option("--bytes", "bytes_", type=str)
@click.option("--max-readers", type=int)
@click.option("--max-files", type=int)
@click.option("--target-rate", type=float)
@click.option("--gpu-ceiling", type=click.Path(dir_okay=False))
@click.option("--run-dir", type=click.Path(file_okay=False))
@quiet_option
@config_option
@json_option
def io_cmd(paths: tuple[str, ...], seconds: float | None, bytes_: str | None, max_readers: int | None,
           max_files: int | None, target_rate: float | None, gpu_ceiling: str | None, run_dir: str | None,
           config_path: str | None, as_json: bool) -> None:
    """Read rate of each PATH (a shard set or an image folder), cold and warm, with 1, 2, 4, ... readers.

    \b
    gpufeed io /nvme/shards /dev/shm/shards --target-rate 3000
    measures both copies the same way, side by side, and says whether each delivers the MB/s that
    3000 samples/s need, and whether the set fits in the page cache and in /dev/shm.
    """
    cfg = load(config_path, "io", {
        "seconds": seconds, "bytes": bytes_, "max_readers": max_readers, "max_files": max_files,
        "target_rate": target_rate, "gpu_ceiling": gpu_ceiling, "run_dir": run_dir})

    def job() -> Any:
        from gpufeed.storage import measure_io

        return measure_io(list(paths), cfg, progress=progress_lines())

    def render(report: Any) -> str:
        from gpufeed.storage import render as render_io

        return render_io(report)

    run_job(job, render, as_json)


@cli.command()
@config_help(StageConfig)
@click.argument("src", type=click.Path())
@click.argument("dest", type=click.Path(file_okay=False))
@click.option("--jobs", type=int)
@click.option("--node-rank", type=int)
@click.option("--num-nodes", type=int)
@quiet_option
@config_option
@json_option
def stage(src: str, dest: str, jobs: int | None, node_rank: int | None, num_nodes: int | None,
          config_path: str | None, as_json: bool) -> None:
    """Copy the shard set SRC (folder or manifest.json) to the local folder DEST: free-space check, parallel
    copies to temporary names, sha256 checked against the manifest, resumable; DEST gets its own manifest."""
    cfg = load(config_path, "stage", {"src": src, "dest": dest, "jobs": jobs, "node_rank": node_rank,
                                      "num_nodes": num_nodes})

    def job() -> Any:
        from gpufeed.stage import stage as run_stage

        return run_stage(cfg, progress=not is_quiet())

    def render(report: Any) -> str:
        from gpufeed.stage import render_stage

        return render_stage(report)

    run_job(job, render, as_json)


@cli.command()
@config_help(LoaderConfig)
@click.argument("paths", nargs=-1, type=click.Path())
@click.option("--num-workers", type=int)
@click.option("--prefetch-factor", type=int)
@click.option("--batch-size", type=int)
@click.option("--image-size", type=int)
@quiet_option
@config_option
@json_option
def doctor(paths: tuple[str, ...], num_workers: int | None, prefetch_factor: int | None, batch_size: int | None,
           image_size: int | None, config_path: str | None, as_json: bool) -> None:
    """Check this machine for training: versions, CUDA driver, GPUs (PCIe link, throttling, ECC), usable cores,
    RAM, /dev/shm against what the [loader] needs, open-file limit, and each DATA_PATH (filesystem, network or
    local, whether its shard set fits the page cache). Exit 1 when a check fails; a machine without a GPU is ok.
    """
    cfg = load(config_path, "loader", {"num_workers": num_workers, "prefetch_factor": prefetch_factor,
                                       "batch_size": batch_size, "image_size": image_size})

    def job() -> Any:
        from gpufeed.doctor import doctor as run_doctor

        return run_doctor(list(paths), cfg)

    def render(report: Any) -> str:
        from gpufeed.doctor import render as render_doctor

        return render_doctor(report)

    run_job(job, render, as_json)


@cli.command()
@config_help(PlanConfig)
@click.option("--arch", type=click.Choice(["resnet18", "resnet34", "resnet50", "resnet101"]))
@click.option("--num-classes", type=int)
@click.option("--batch-size", type=int)
@click.option("--image-size", type=int)
@click.option("--amp", type=click.Choice(["auto", "bf16", "fp16", "off"]))
@click.option("--channels-last/--no-channels-last", default=None)
@click.option("--optimizer", type=click.Choice(["sgd", "adamw"]))
@click.option("--device")
@click.option("--measure-batches", type=int, nargs=2, default=None, metavar="B1 B2")
@click.option("--check-batch", type=int)
@click.option("--gpu-memory", type=str)
@click.option("--headroom", type=float)
@click.option("--target-rate", type=float)
@click.option("--record", type=click.Path(dir_okay=False))
@click.option("--gpus", type=int)
@click.option("--trainer-cores", type=int)
@quiet_option
@config_option
@json_option
def plan(arch: str | None, num_classes: int | None, batch_size: int | None, image_size: int | None,
         amp: str | None, channels_last: bool | None, optimizer: str | None, device: str | None,
         measure_batches: tuple[int, int] | None, check_batch: int | None, gpu_memory: str | None,
         headroom: float | None, target_rate: float | None, record: str | None, gpus: int | None,
         trainer_cores: int | None, config_path: str | None, as_json: bool) -> None:
    """Measure real training steps at small batch sizes, model the peak memory as linear in the batch size, check
    it at a third batch, and say whether --batch-size fits the GPU memory (largest batch that does) and how many
    loader cores per GPU the target rate needs (with --record). Exit 1 when the batch does not fit or the cores
    are too few.

    \b
    gpufeed plan --arch resnet50 --batch-size 256 --amp bf16 --channels-last --gpu-memory 80GiB
    """
    cfg = load(config_path, "plan", {
        "arch": arch, "num_classes": num_classes, "batch_size": batch_size, "image_size": image_size, "amp": amp,
        "channels_last": channels_last, "optimizer": optimizer, "device": device,
        "measure_batches": list(measure_batches) if measure_batches else None, "check_batch": check_batch,
        "gpu_memory": gpu_memory, "headroom": headroom, "target_rate": target_rate, "record": record,
        "gpus": gpus, "trainer_cores": trainer_cores})

    def job() -> Any:
        from gpufeed.memplan import plan as run_plan

        return run_plan(cfg)

    def render(report: Any) -> str:
        from gpufeed.memplan import render as render_plan

        return render_plan(report)

    run_job(job, render, as_json)


@cli.command("config")
@click.option("--defaults", is_flag=True,
              help="Print the built-in defaults (what configs/default.toml holds).")
@quiet_option
@config_option
@json_option
def config_cmd(defaults: bool, config_path: str | None, as_json: bool) -> None:
    """Print a configuration as commented TOML, every section and key: the built-in defaults (--defaults), or
    FILE resolved over them (--config FILE; exit 2 when FILE has an error). Generated from the config classes,
    so it is always the installed version's.

    \b
    gpufeed config --defaults > my.toml     a starting point: edit it, then gpufeed CMD --config my.toml
    """
    if defaults == (config_path is not None):
        fail("give --defaults or --config FILE (one of them)", 2)

    def job() -> Any:
        from gpufeed.config import load_config

        return load_config(config_path)

    def render(cfg: Any) -> str:
        from gpufeed.config import render_config

        return render_config(cfg)

    run_job(job, render, as_json)


def main() -> None:
    cli(prog_name="gpufeed")

