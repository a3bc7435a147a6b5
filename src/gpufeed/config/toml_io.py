"""Config files in and out: ``read_toml`` (bounded, UTF-8, one sentence per failure), ``load_config`` (CLI > file >
defaults, unknown keys refused, every value type-checked against its field's annotation), ``to_toml`` and
``render_config`` (the commented defaults). See docs/design.md section 7. No torch here: ``gpufeed --help`` loads
it.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from gpufeed.config.help import field_doc, help_value, range_text
from gpufeed.config.limits import MAX_CONFIG_BYTES, parse_size, show_value
from gpufeed.config.schema import DEFAULT_STEPS, SECTIONS, Config, ShardConfig
from gpufeed.core.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def read_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file of at most ``MAX_CONFIG_BYTES``, turning every failure into one ConfigError naming it."""
    import os

    from gpufeed.core.errors import DataError
    from gpufeed.core.safefs import open_user_file

    p = Path(path)
    try:  # a regular file (a link is fine: the user named it), never a FIFO that would block the read
        with os.fdopen(open_user_file(p, what="config file"), "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except DataError as exc:
        raise ConfigError(str(exc)) from None
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"config file {p} cannot be read ({exc.strerror or exc})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {p} is larger than {MAX_CONFIG_BYTES} bytes; a config file is a few KiB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {p} is not UTF-8 text (byte {exc.start} is {raw[exc.start]:#04x}); "
                          f"TOML files must be UTF-8") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {p} is not valid TOML: {exc}") from None
    except ValueError as exc:  # e.g. an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise ConfigError(f"config file {p} holds a value that cannot be read ({str(exc)[:120]})") from None
    except RecursionError:
        raise ConfigError(f"config file {p} nests arrays or tables too deeply") from None


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Resolve every section: CLI ``overrides`` ("section.key" -> value, None = not given) > file > defaults."""
    data = read_toml(path) if path is not None else {}
    where = f"config file {path}" if path is not None else "config"
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"{where}: unknown section(s) {unknown}; known: {sorted(SECTIONS)}")
    for name in SECTIONS:
        if not isinstance(data.get(name, {}), dict):
            raise ConfigError(f"{where}: [{name}] must be a table")
    _moved_keys(data, where)
    per_section: dict[str, dict[str, Any]] = {name: dict(data.get(name, {})) for name in SECTIONS}
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        section_name, _, key = dotted.partition(".")
        if section_name not in SECTIONS or not key:
            raise ConfigError(f"bad override key {dotted!r}: expected 'section.key'")
        per_section[section_name][key] = value
    val = per_section["shard"].pop("val", None)  # [shard.val]: a sub-table, not a [shard] key
    if "steps" not in per_section["run"] and any(per_section["train"].get(k) is not None for k in ("epochs", "steps")):
        per_section["run"]["steps"] = (*DEFAULT_STEPS, "train")  # [train] asks for a training: run it
    built = {name: build_section(SECTIONS[name], values, f"{where} [{name}]") for name, values in per_section.items()}
    return Config(**built, shard_val=_shard_val(per_section["shard"], val, where))


VAL_MOVED = {"val_src": "src", "val_dest": "dest"}
"""[run] keys of an earlier gpufeed run, now [shard.val]'s."""


def _shard_val(shard: dict[str, Any], val: Any, where: str) -> ShardConfig | None:
    """[shard.val]: [shard]'s values (src and dest left out, prefix "val"), each key of the sub-table over them."""
    if val is None:
        return None
    if not isinstance(val, dict):
        raise ConfigError(f"{where}: [shard.val] must be a table (the validation set's src, dest and [shard] keys)")
    if val.get("src") is None:
        raise ConfigError(f"{where} [shard.val]: src is missing (the image folder to shard as the validation set)")
    inherited = {k: v for k, v in shard.items() if k not in ("src", "dest", "prefix")}
    return build_section(ShardConfig, {**inherited, "prefix": "val", **val}, f"{where} [shard.val]")


def _moved_keys(data: dict[str, Any], where: str) -> None:
    run = data.get("run")
    moved = sorted(set(run) & set(VAL_MOVED)) if isinstance(run, dict) else []
    if moved:
        raise ConfigError(f"{where} [run]: {', '.join(moved)} moved to the [shard.val] table: write "
                          + ", ".join(f"{VAL_MOVED[k]} = ... under [shard.val]" for k in moved))


def build_section(cls: type, values: dict[str, Any], where: str = "config") -> Any:
    """Build one config dataclass from a plain mapping, rejecting unknown keys and wrong types."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; known: {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    checked = {}
    for key, value in values.items():
        f = fields[key]
        if f.metadata.get("size") and value is not None:
            try:
                value = parse_size(value)
            except ConfigError as exc:
                raise ConfigError(f"{where} {key}: {exc}") from None
        checked[key] = _coerce(value, hints[key], f"{where} {key}")
    try:
        return cls(**checked)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def to_toml(section: str, cfg: Any, *, skip_none: bool = True, header: str = "") -> str:
    """Render one config dataclass as a TOML section that ``load_config`` reads back."""
    lines = [f"# {line}" for line in header.splitlines()] + [f"[{section}]"]
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if value is None and skip_none:
            continue
        lines.append(f"{f.name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


CONFIG_HEADER = """gpufeed configuration, one section per job: gpufeed CMD --config FILE reads it.
Precedence: CLI > this file > built-in defaults. Unknown sections and keys are errors; every number is
range-checked. Sizes accept "1GB", "512MiB" or plain bytes. A commented-out key has no default value: its
comment says what leaving it out means.
Generated from the config classes (src/gpufeed/config/schema.py) by: gpufeed config --defaults"""


def render_config(cfg: Config | None = None, header: str = CONFIG_HEADER) -> str:
    """Every section and key of ``cfg`` (default: the built-in defaults) as commented TOML that ``load_config``
    reads back to ``cfg``: each key under its field's docstring and range, sizes as ``1GB``, unset (None) keys
    commented out. ``gpufeed config --defaults`` prints it; ``configs/default.toml`` is this text."""
    import textwrap

    cfg = Config() if cfg is None else cfg
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    for name, cls in SECTIONS.items():
        section = getattr(cfg, name)
        about = " ".join((cls.__doc__ or "").replace("``", "").split())
        lines += ["", f"[{name}]"] + textwrap.wrap(about, 116, initial_indent="# ", subsequent_indent="# ")
        for f in dataclasses.fields(cls):
            doc = field_doc(cls, f.name)
            if "max" in f.metadata:
                doc += f"  [{range_text(f)}]"
            lines += [""] + textwrap.wrap(doc, 116, initial_indent="# ", subsequent_indent="# ")
            value = getattr(section, f.name)
            if value is None:
                lines.append(f"# {f.name} =")
            elif f.metadata.get("size") and isinstance(value, int) and not isinstance(value, bool):
                lines.append(f"{f.name} = {_toml_value(help_value(value, size=True))}")
            else:
                lines.append(f"{f.name} = {_toml_value(value)}")
        if name == "shard":
            lines += _render_shard_val(cfg)
    return "\n".join(lines) + "\n"


def _render_shard_val(cfg: Config) -> list[str]:
    """[shard.val]: its keys that differ from what [shard] gives it (src and dest always), so that it reads back
    to ``cfg.shard_val``; without one, the table commented out under its docstring."""
    import textwrap

    about = textwrap.wrap(field_doc(Config, "shard_val"), 116, initial_indent="# ", subsequent_indent="# ")
    if cfg.shard_val is None:
        return ["", *about, "# [shard.val]", "# src =", "# dest ="]
    val = cfg.shard_val
    inherited = dataclasses.replace(cfg.shard, src=None, dest=None, prefix="val")
    lines = ["", *about, "[shard.val]"]
    for f in dataclasses.fields(val):
        value = getattr(val, f.name)
        if value != getattr(inherited, f.name):  # src and dest always: [shard.val] inherits neither
            lines.append(f"{f.name} = {_toml_value(value)}")
    return lines


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise ConfigError(f"cannot write {value!r} to TOML")


def _toml_string(text: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters escaped, so that every string (a path
    holding a tab or a newline included) reads back as it was written."""
    out = ['"']
    for ch in text:
        o = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif o < 0x20 or o == 0x7F:
            out.append(f"\\u{o:04x}")
        elif 0xD800 <= o <= 0xDFFF:
            raise ConfigError(f"cannot write {text[:80]!r} to TOML: it holds bytes that are not UTF-8 text")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _coerce(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {show_value(value)}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where} must be one of {list(args)}, got {show_value(value)}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {show_value(value)}")
        inner = args[0] if args else Any
        items = [_coerce(v, inner, where) for v in value]
        return tuple(items) if origin is tuple else items
    if hint is Any:
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be true or false, got {show_value(value)}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where} must be an integer, got {show_value(value)}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:
                raise ConfigError(f"{where} is too large, got {show_value(value)}") from None
        raise ConfigError(f"{where} must be a number, got {show_value(value)}")
    if hint is str:
        if isinstance(value, (str, Path)):
            return str(value)
        raise ConfigError(f"{where} must be a string, got {show_value(value)}")
    return value
