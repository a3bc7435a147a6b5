"""Options generated from config fields, and the options every command shares. See docs/design.md section 7.

``field_options("shard", "workers", "seed")`` makes ``--workers`` and ``--seed`` from the fields of
``[shard]``: the flag from the field's name, the type and choices from its annotation (a ``Literal`` becomes a
``Choice``, a bool a ``--x/--no-x`` switch, a size a string such as ``1GB``), the help from its docstring, default
and range (``config.field_help``). An option given sets ``section.field`` over the config file; one not given
(None) leaves the file's value or the default. No torch here: ``gpufeed --help`` loads it.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Callable, Literal

import click

from gpufeed.config import SECTIONS, field_help

_FILE = click.Path(dir_okay=False)
_DIR = click.Path(file_okay=False)
PATH_TYPES: dict[str, click.Path] = {
    "shards": click.Path(), "val_shards": click.Path(), "src": _DIR, "dest": _DIR,
    "run_dir": _DIR, "checkpoint_dir": _DIR, "baseline_imagefolder": _DIR,
    "out": _FILE, "classes_file": _FILE, "storage_record": _FILE, "gpu_ceiling": _FILE, "record": _FILE,
}
"""Fields that name a path, by field name, and what the command line accepts there (a file, a folder, either)."""
FLAGS = {"budget_s": "--budget", "window_s": "--window", "classes_file": "--classes",
         "storage_bytes_per_s": "--storage-rate"}
"""Flags that are not the field's name with dashes."""


class FieldParam:
    """A parameter that sets config field ``[section] field``: ``key`` is its ``load_config`` override."""

    section: str
    field: str

    @property
    def key(self) -> str:
        return f"{self.section}.{self.field}"


class FieldOption(FieldParam, click.Option):
    """An option that sets a config field. Without help of its own it shows the field's (``field_help``), written
    when first asked for: that reads config/schema.py's source (~20 ms), which a command that runs should not pay."""

    def __init__(self, decls: list[str], *, section: str, field: str, **attrs: Any) -> None:
        self.section, self.field = section, field
        super().__init__(decls, **attrs)

    @property  # type: ignore[override]
    def help(self) -> str | None:
        if self._help is None:
            self._help = field_help(SECTIONS[self.section], self.field)
        return self._help

    @help.setter
    def help(self, value: str | None) -> None:
        self._help = value


class FieldArgument(FieldParam, click.Argument):
    """An argument (SRC, DEST, SHARDS) that sets a config field."""

    def __init__(self, section: str, field: str, **attrs: Any) -> None:
        self.section, self.field = section, field
        super().__init__([field], **{"type": PATH_TYPES.get(field), **attrs})


def field_option(section: str, name: str, flag: str | None = None, *, switch: bool = True,
                 **attrs: Any) -> FieldOption:
    """The option for field ``name`` of ``[section]``: ``--name-with-dashes`` (or ``flag``); a bool is a
    ``--x/--no-x`` switch, or with ``switch=False`` a flag that only turns it on; ``attrs`` go to ``click.Option``
    (``nargs`` for a tuple field, ``flag_value`` for a flag that picks one value of a field)."""
    f = {f.name: f for f in dataclasses.fields(SECTIONS[section])}[name]
    hint = _optional_inner(typing.get_type_hints(SECTIONS[section])[name])
    flag = flag or FLAGS.get(name) or "--" + name.replace("_", "-")
    if "flag_value" in attrs:  # a flag that picks one value of the field (--synthetic): no type of its own
        pass
    elif hint is bool:
        attrs.setdefault("default", None)
        if switch:
            flag = f"{flag}/--no-{flag[2:]}"
        else:
            attrs["is_flag"] = True
    elif f.metadata.get("size"):
        attrs.setdefault("type", str)
    elif typing.get_origin(hint) is Literal:
        attrs.setdefault("type", click.Choice(list(typing.get_args(hint))))
    elif typing.get_origin(hint) is tuple:
        attrs.setdefault("type", typing.get_args(hint)[0])
        attrs.setdefault("default", None)
    else:
        attrs.setdefault("type", PATH_TYPES.get(name, hint))
    return FieldOption([flag, name], section=section, field=name, **attrs)


def field_options(section: str, *names: str) -> tuple[FieldOption, ...]:
    """``field_option`` of each of ``names``, in that order (the order ``--help`` lists them)."""
    return tuple(field_option(section, name) for name in names)


def _optional_inner(hint: Any) -> Any:
    """``X`` of ``X | None``; any other hint as it is."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if type(None) in typing.get_args(hint) and len(args) == 1 else hint


# --------------------------------------------------------------------------- the options every command shares

JSON = "gpufeed.json"
QUIET = "gpufeed.quiet"
"""Keys of ``click.Context.meta`` (shared by the group's and the command's context): --json and --quiet given."""


def _remember(key: str) -> Callable[[click.Context, click.Parameter, Any], Any]:
    def callback(ctx: click.Context, _param: click.Parameter, value: Any) -> Any:
        if value:
            ctx.meta[key] = True
        return value

    return callback


def config_option() -> click.Option:
    return click.Option(["--config", "config_path"], type=click.Path(exists=True, dir_okay=False),
                        help="TOML config file (configs/*.toml); CLI options override it.")


def json_option() -> click.Option:
    return click.Option(
        ["--json", "as_json"], is_flag=True, callback=_remember(JSON),
        help="Print exactly one JSON object (the summary record, or {\"error\": ..., \"exit_code\": ...}) on stdout; "
             "human text goes to stderr.")


def quiet_option() -> click.Option:
    """``--quiet`` on a command (also ``gpufeed --quiet CMD``): read with :func:`is_quiet`."""
    return click.Option(["--quiet"], is_flag=True, expose_value=False, callback=_remember(QUIET),
                        help="No progress bars or notes (errors, the result and the --json record stay).")


def is_quiet() -> bool:
    """``--quiet`` was given (on the command or the group). Progress bars are also off when stderr is not a
    terminal (``gpufeed.core.progress``)."""
    ctx = click.get_current_context(silent=True)
    return bool(ctx is not None and ctx.meta.get(QUIET))
