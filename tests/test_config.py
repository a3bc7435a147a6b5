from __future__ import annotations

from pathlib import Path

import pytest

from gpufeed.config import LoaderConfig, ShardConfig, load_config, parse_size, read_toml, to_toml
from gpufeed.errors import ConfigError


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
