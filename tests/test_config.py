from __future__ import annotations

from pathlib import Path

import pytest

from gpufeed.config import LoaderConfig, ShardConfig, load_config, parse_size, read_toml, to_toml
from gpufeed.core.errors import ConfigError


def test_defaults_without_file() -> None:
    cfg = load_config()
    assert cfg.shard == ShardConfig()
    assert cfg.loader == LoaderConfig()


def test_precedence_cli_over_file_over_defaults(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('[shard]\nseed = 7\nprefix = "val"\nshard_bytes = "2MB"\n')
    cfg = load_config(p, {"shard.seed": 9, "shard.prefix": None})
    assert cfg.shard.seed == 9  # CLI wins
    assert cfg.shard.prefix == "val"  # file wins over default; None means "not given"
    assert cfg.shard.shard_bytes == 2_000_000
    assert cfg.shard.shard_samples == ShardConfig().shard_samples  # default


@pytest.mark.parametrize(
    "text, needle",
    [
        ("[shard]\nseeed = 1\n", "unknown key(s) ['seeed']"),
        ("[shards]\nseed = 1\n", "unknown section(s) ['shards']"),
        ("[shard]\nseed = 'x'\n", "seed must be an integer"),
        ("[shard]\ncheck = 'some'\n", "check must be one of"),
        ("[loader]\nnum_workers = -1\n", "num_workers must be >= 0"),
        ("[shard]\nseed = \n", "not valid TOML"),
    ],
)
def test_bad_files_name_the_problem(tmp_path: Path, text: str, needle: str) -> None:
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_config(p)
    assert needle in str(exc.value)


def test_parse_size() -> None:
    assert parse_size("1GB") == 10**9
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("1.5k") == 1500
    assert parse_size(4096) == 4096
    with pytest.raises(ConfigError):
        parse_size("lots")


def test_to_toml_round_trips(tmp_path: Path) -> None:
    cfg = LoaderConfig(num_workers=3, pin_memory=False, decode="pil")
    p = tmp_path / "tuned.toml"
    p.write_text(to_toml("loader", cfg, header="written by a test"))
    assert load_config(p).loader == cfg
    assert "loader" in read_toml(p)


def test_shipped_configs_load() -> None:
    root = Path(__file__).resolve().parents[1] / "configs"
    files = sorted(root.glob("*.toml"))
    assert files, "configs/*.toml missing"
    for f in files:
        load_config(f)


# --------------------------------------------------------------------------- bounds (every numeric knob)


def _numeric_fields() -> list[tuple[str, str, bool]]:
    """(section, key, is_int) for every int/float field of every section: a new field is covered by default."""
    import dataclasses
    import typing

    from gpufeed.config import SECTIONS

    out = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            args = set(typing.get_args(hints[f.name])) or {hints[f.name]}
            if args & {int, float}:
                out.append((section, f.name, float not in args))
    return out


NUMERIC_FIELDS = _numeric_fields()


def test_the_table_covers_the_known_knobs() -> None:
    keys = {(s, k) for s, k, _ in NUMERIC_FIELDS}
    assert {("loader", "prefetch_factor"), ("loader", "max_pixels"), ("shard", "shard_bytes"),
            ("tune", "budget_s"), ("train", "lr"), ("synth", "images")} <= keys
    assert len(keys) >= 50


@pytest.mark.parametrize("section, key, is_int", NUMERIC_FIELDS, ids=[f"{s}.{k}" for s, k, _ in NUMERIC_FIELDS])
def test_every_numeric_knob_has_an_upper_bound(tmp_path: Path, section: str, key: str, is_int: bool) -> None:
    import dataclasses

    from gpufeed.config import SECTIONS

    f = {f.name: f for f in dataclasses.fields(SECTIONS[section])}[key]
    assert "max" in f.metadata, f"[{section}] {key} declares no bound (use config.bounded)"
    hi = f.metadata["max"]
    above = 10**20 if hi < 10**19 else 2**63 - 1  # 2**63-1: the largest TOML integer
    assert above > hi
    p = tmp_path / "c.toml"
    p.write_text(f"[{section}]\n{key} = {above}\n")
    with pytest.raises(ConfigError) as exc:
        load_config(p)
    msg = str(exc.value)
    assert f"config file {p} [{section}]" in msg and key in msg and str(hi) in msg, msg
    # The same bound holds for a value from the command line (a Python int of any size).
    with pytest.raises(ConfigError, match=key):
        load_config(None, {f"{section}.{key}": 10**5000})
    if not is_int:
        for bad in ("nan", "inf", "-inf"):
            p.write_text(f"[{section}]\n{key} = {bad}\n")
            with pytest.raises(ConfigError, match=f"{key} must be"):
                load_config(p)


def test_absurd_prefetch_factor_is_refused_with_the_bound(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text("[loader]\nprefetch_factor = 99999999999999999999\n")  # > 2**63: tomllib reads it anyway
    with pytest.raises(ConfigError) as exc:
        load_config(p)
    assert str(exc.value) == f"config file {p} [loader]: prefetch_factor must be <= 64, got 99999999999999999999"
    with pytest.raises(ConfigError) as exc:
        load_config(None, {"loader.prefetch_factor": 99999999999999999999})
    assert str(exc.value) == "config [loader]: prefetch_factor must be <= 64, got 99999999999999999999"
    assert load_config(None, {"loader.prefetch_factor": 64}).loader.prefetch_factor == 64
    with pytest.raises(ConfigError, match="seed must be >= 0, got -1"):
        load_config(None, {"shard.seed": -1})


def test_cli_refuses_an_absurd_knob_with_exit_2(tmp_path: Path) -> None:
    from tests.common.cli import invoke

    p = tmp_path / "c.toml"
    p.write_text("[loader]\nprefetch_factor = 1000000\n")
    res = invoke(["tune", tmp_path / "shards", "--config", p], expect=2)
    assert "prefetch_factor must be <= 64" in res.stderr and str(p) in res.stderr
    assert "Traceback" not in res.stderr


# --------------------------------------------------------------------------- hostile files


def test_non_utf8_file_is_one_sentence(tmp_path: Path) -> None:
    p = tmp_path / "latin1.toml"
    p.write_bytes('[shard]\nprefix = "caf\xe9"\n'.encode("latin-1"))
    with pytest.raises(ConfigError) as exc:
        load_config(p)
    assert str(exc.value) == f"config file {p} is not UTF-8 text (byte 21 is 0xe9); TOML files must be UTF-8"


def test_an_integer_too_long_to_convert_is_one_sentence(tmp_path: Path) -> None:
    """tomllib raises a plain ValueError (not TOMLDecodeError) past Python's int digit limit."""
    p = tmp_path / "big.toml"
    p.write_text("[train]\nlr = " + "9" * 5000 + "\n")
    with pytest.raises(ConfigError) as exc:
        load_config(p)
    assert str(exc.value).startswith(f"config file {p} holds a value that cannot be read (")
    from tests.common.cli import invoke

    res = invoke(["tune", tmp_path, "--config", p], expect=2)
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_bad_size_names_file_section_and_key(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text("[shard]\nshard_bytes = '1 potato'\n")
    with pytest.raises(ConfigError) as exc:
        load_config(p)
    assert str(exc.value) == (f"config file {p} [shard] shard_bytes: expected a size such as 1GB or 512MiB, "
                              f"got '1 potato'")
    p.write_text("[tune]\nram_budget = '" + "9" * 400 + "PB'\n")
    with pytest.raises(ConfigError, match=rf"\[tune\] ram_budget: expected a size .* 402-character string"):
        load_config(p)
    p.write_text("[tune]\nram_budget = '" + "9" * 40 + "PB'\n")
    with pytest.raises(ConfigError, match=r"\[tune\]: ram_budget must be <= 1125899906842624"):
        load_config(p)
    p.write_text("[shard]\nshard_bytes = inf\n")
    with pytest.raises(ConfigError, match=r"\[shard\] shard_bytes: a size must be a finite number"):
        load_config(p)


def test_huge_deep_or_unreadable_files_are_refused(tmp_path: Path) -> None:
    from gpufeed.config import MAX_CONFIG_BYTES

    big = tmp_path / "big.toml"
    big.write_text("# " + "x" * MAX_CONFIG_BYTES + "\n")
    with pytest.raises(ConfigError, match=f"larger than {MAX_CONFIG_BYTES} bytes"):
        load_config(big)
    deep = tmp_path / "deep.toml"
    deep.write_text("[shard]\nseed = " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match="(nests .* too deeply|not valid TOML)"):
        load_config(deep)
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config(tmp_path)  # a folder


# --------------------------------------------------------------------------- help text from the field docs


def test_field_help_renders_doc_default_and_range() -> None:
    from gpufeed.config import TrainConfig, TuneConfig, field_help

    # a size default and size bounds in their largest exact unit
    assert field_help(ShardConfig, "shard_bytes") == \
        "Target bytes per shard (bytes or a size such as 1GB, 512MiB).  [default: 1GB; 1B<=x<=1TiB]"
    # a closing "None = ..." clause of the docstring is the shown default
    assert field_help(TuneConfig, "max_workers") == \
        ("Largest num_workers per rank tried.  [default: the loaders' share of the usable CPUs (x cpu_budget, less "
         "trainer_cores per rank) split over the ranks, rounded down; 0<=x<=1024]")
    # open bounds, floats, 2**63-1, strings, and a field with neither default nor range
    assert field_help(TrainConfig, "label_smoothing") == "Cross-entropy label smoothing.  [default: 0.1; 0<=x<1]"
    assert field_help(LoaderConfig, "crop_ratio").endswith("[default: 0.875; 0<x<=1]")
    assert field_help(ShardConfig, "seed").endswith("[default: 0; 0<=x<=2**63-1]")
    assert field_help(ShardConfig, "prefix") == "Shard file prefix: train, val, ...  [default: train]"
    assert field_help(TrainConfig, "master_addr") == "Static rendezvous host (rank 0's node)."
    # multi-line docstrings are joined and ``markup`` dropped
    assert "\n" not in field_help(LoaderConfig, "max_pixels") and "``" not in field_help(LoaderConfig, "max_pixels")


@pytest.mark.parametrize("section", ["shard", "loader", "tune", "train", "synth"])
def test_every_field_has_a_docstring_and_no_raw_none(section: str) -> None:
    import dataclasses

    from gpufeed.config import SECTIONS, field_help

    for f in dataclasses.fields(SECTIONS[section]):
        text = field_help(SECTIONS[section], f.name)
        assert not text.startswith("[") and len(text.split("  [")[0]) > 3, f"[{section}] {f.name} has no docstring"
        # "None = ..." must close the docstring, where it becomes the shown default
        assert "None =" not in text, f"[{section}] {f.name}: {text}"


def test_every_string_reads_back_from_to_toml(tmp_path: Path) -> None:
    """Run folders store the resolved config with to_toml and torchrun ranks read it back: a path holding a tab,
    a newline, quotes or DEL must survive."""
    from gpufeed.config import TrainConfig, to_toml

    odd = '/data/x\ny"\\z\x7f\tend'
    p = tmp_path / "c.toml"
    p.write_text(to_toml("train", TrainConfig(run_dir="runs/a\tb", shards=odd)))
    got = load_config(p).train
    assert got.shards == odd and got.run_dir == "runs/a\tb"


def test_tune_device_is_checked_at_load(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('[tune]\ndevice = "bogus"\n')
    with pytest.raises(ConfigError, match="device must be auto, cpu, cuda or cuda:N, got 'bogus'"):
        load_config(p)


def test_sizes_take_an_exponent() -> None:
    from gpufeed.config import parse_size

    assert parse_size("1e9") == 10**9 and parse_size("1.5e3MB") == 1_500_000_000
    with pytest.raises(ConfigError, match="finite"):
        parse_size("1e999")
