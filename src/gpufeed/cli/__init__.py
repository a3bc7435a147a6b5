"""The ``gpufeed`` command: a thin Click shell around library calls. See docs/design.md sections 1 and 6.

Every command parses options, resolves its config (CLI > file > defaults), calls one job function and renders
the record it returns; the commands are the table ``cli.commands.COMMANDS``, their config options generated from
the config fields (``cli.options``). Heavy imports (torch, PIL, webdataset) happen inside commands, so
``gpufeed --help`` stays fast. Exit codes: 0 ok, 1 the job ran but a check failed, 2 usage or input error (one
sentence, no traceback). With ``--json`` stdout carries exactly one JSON object, the command's summary record,
or on an error ``{"error": sentence, "exit_code": N, "command": name}``; human text goes to stderr. ``--quiet``
(on every command, or before it) turns progress and notes off.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable

import click

from gpufeed.cli.commands import COMMANDS, Job, Shell
from gpufeed.cli.options import JSON, FieldParam, config_option, is_quiet, json_option, quiet_option
from gpufeed.core.errors import GpufeedError


def progress_lines() -> Callable[[str], None] | None:
    """The progress callback of a job that reports in lines (tune's trials, io's steps): each line on stderr, or
    None with --quiet (decided here, in the command's thread)."""
    return None if is_quiet() else lambda line: say(line, err=True)


def json_error(message: str, exit_code: int, command: str | None = None) -> None:
    """Under ``--json``, the error as the one JSON object on stdout (the sentence still goes to stderr)."""
    ctx = click.get_current_context(silent=True)
    if ctx is None or not ctx.meta.get(JSON):
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
    gpufeed run     CONFIG.toml    doctor -> shard -> verify -> io -> tune -> train --measure, resumable
    gpufeed report  RUN_DIR        one self-contained HTML page (+ Markdown) from a run's records

    Progress bars are drawn only when stderr is a terminal (GPUFEED_PROGRESS=1 forces them on, 0 off).
    Shell completion: eval "$(_GPUFEED_COMPLETE=bash_source gpufeed)" (zsh_source, fish_source).
    """
    if verbose:
        import os

        os.environ["GPUFEED_VERBOSE"] = "1"  # torchrun ranks inherit it


cli.params.append(quiet_option())


def _resolve(config_path: str | None, args: dict[str, Any], params: list[click.Parameter]) -> Any:
    """The config, CLI > file > defaults: each parameter that sets a config field, taken out of ``args``, overrides
    the file (None = not given); exit 2 with one sentence when the file or a value is wrong."""
    from gpufeed.config import load_config

    keys = {p.name: p.key for p in params if isinstance(p, FieldParam) and p.name}
    try:
        return load_config(config_path, {key: args.pop(name) for name, key in keys.items()})
    except GpufeedError as exc:
        fail(str(exc), exc.exit_code)


def _render(where: str) -> Callable[[Any], str]:
    """The renderer ``module:function``, imported when the record is rendered."""
    def render(record: Any) -> str:
        module, _, name = where.partition(":")
        return getattr(importlib.import_module(module), name)(record)

    return render


def _check_locations(args: dict[str, Any]) -> None:
    """Exit 2 before any work when a typed value starts like a URL gpufeed does not read (``ftp://``), or is a URL
    holding a control character (:func:`gpufeed.shardset.source.check_location`)."""
    from gpufeed.shardset.source import check_location

    for value in args.values():
        for text in value if isinstance(value, (list, tuple)) else (value,):
            try:
                check_location(text)
            except GpufeedError as exc:
                fail(str(exc), exc.exit_code)


def _command(job: Job) -> click.Command:
    """``gpufeed NAME`` from its row of the table: parse, resolve the config, run the entry, render, exit."""
    def callback(as_json: bool, **args: Any) -> None:
        _check_locations(args)
        conf = _resolve(args.pop("config_path", None), args, params) if job.load else None
        shell = Shell(quiet=is_quiet(), lines=progress_lines())
        run_job(lambda: job.entry(conf, shell, **args), _render(job.render), as_json)

    shared = [quiet_option(), *([config_option()] if job.config else []), json_option()]
    params = [*job.params, *shared]
    return click.Command(job.name, callback=callback, params=params, help=job.entry.__doc__)


for _job in COMMANDS:
    cli.add_command(_command(_job))


def main() -> None:
    cli(prog_name="gpufeed")
