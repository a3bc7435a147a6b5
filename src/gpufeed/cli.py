"""The ``gpufeed`` command: a thin Click shell around library calls.

Every command parses options, resolves its config (CLI > file > defaults), calls one job function
and renders the record it returns. Heavy imports (torch, PIL, webdataset) happen inside commands,
so ``gpufeed --help`` stays fast. Exit codes: 0 ok, 1 the job ran but a check failed, 2 usage or
input error (one sentence, no traceback). With ``--json`` stdout carries exactly one JSON object,
the command's summary record; human text goes to stderr.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import click

from gpufeed import __version__
from gpufeed.errors import GpufeedError


class InputError(click.ClickException):
    """A usage or input error: one sentence on stderr, exit code 2."""

    exit_code = 2


def config_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--config", "config_path", type=click.Path(exists=True, dir_okay=False),
        help="TOML config file (configs/*.toml); CLI options override it.",
    )(f)


def json_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--json", "as_json", is_flag=True,
        help="Print exactly one JSON object (the summary record) on stdout; human text goes to stderr.",
    )(f)


def run_job(job: Callable[[], Any], render: Callable[[Any], str], as_json: bool) -> None:
    """Call ``job``, render its record, and exit 0, or 1 when the record says a check failed.

    A record signals a failed check with a false ``ok`` attribute (or key).
    """
    try:
        record = job()
    except GpufeedError as exc:
        raise InputError(str(exc)) from None
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    human = render(record)
    if as_json:
        from gpufeed.records import dumps

        if human:
            click.echo(human, err=True)
        click.echo(dumps(record, indent=None))
    elif human:
        click.echo(human)
    ok = record.get("ok", True) if isinstance(record, dict) else getattr(record, "ok", True)
    sys.exit(0 if ok else 1)


def load(config_path: str | None, section: str, overrides: dict[str, Any]) -> Any:
    """Resolve one section of the config (CLI > file > defaults) or fail with exit code 2."""
    from gpufeed.config import load_config

    try:
        cfg = load_config(config_path, {f"{section}.{k}": v for k, v in overrides.items()})
    except GpufeedError as exc:
        raise InputError(str(exc)) from None
    return getattr(cfg, section)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="gpufeed")
def cli() -> None:
    """Keep GPUs fed: image folder -> WebDataset shards -> tuned loader -> measured training.

    \b
    gpufeed synth   DEST           make a small ImageNet-like image folder (demo, tests, benchmarks)
    gpufeed shard   SRC DEST       image folder -> deterministic, verified WebDataset shards
    gpufeed verify  DEST           re-read a shard set against its manifest
    gpufeed index   SHARDS         build the manifest for shards written by other tools
    gpufeed tune    SHARDS         measured DataLoader sweep -> [loader] config
    gpufeed train   --shards DEST  AMP + DDP ResNet run with a fed/starved verdict
    """


# Commands are added below, one per job; each imports its job module inside the function.


def main() -> None:
    cli(prog_name="gpufeed")


if __name__ == "__main__":
    main()
