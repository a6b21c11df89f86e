"""Configuration loading: lattices, streams, and errors that name the line and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from strata.config import ConfigError, load_config, parse_config
from strata.lattice import ChineseWall, TotalOrder


def test_total_order_and_streams(battlefield):
    assert isinstance(battlefield.lattice, TotalOrder)
    assert battlefield.lattice.levels == ("U", "C", "S", "TS")
    v = battlefield.streams["Vitals"]
    assert v.columns == (("sid", "string"), ("bp", "double"), ("pr", "double"), ("weight", "double"))
    assert v.type_of("level") == "level" and v.type_of("ts") == "long"
    assert battlefield.stream("vitals") is v
    assert battlefield.instant_seconds == 1.0


def test_chinese_wall(chinese_wall):
    assert isinstance(chinese_wall.lattice, ChineseWall)
    assert chinese_wall.lattice.coi == (("1", "2"), ("A", "B", "C"))


def test_all_types_and_instant_length():
    cfg = parse_config(
        '[lattice]\nlevels = ["L", "H"]\n[time]\ninstant_seconds = 0.5\n'
        '[streams.S]\na = "string"\nb = "double"\nc = "long"\nd = "boolean"\ne = "timestamp"\n'
    )
    assert [t for _, t in cfg.streams["S"].columns] == ["string", "double", "long", "boolean", "timestamp"]
    assert cfg.instant_seconds == 0.5


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("[lattice]\nlevels = [\"U\", \"U\"]\n", ":2: [lattice] levels: duplicate level 'U'"),
        ("[lattice]\nlevels = [\"U\"]\ncoi = [[\"a\"]]\n", "exactly one of"),
        ("[lattice]\ncoi = [[\"1\", \"T\"]]\n", ":2: [lattice] coi"),
        ("[lattice]\nlevelz = [\"U\"]\n", ":2: [lattice] levelz: unknown key"),
        ("[streams.V]\nbp = \"double\"\n", "missing [lattice]"),
        ("[lattice]\nlevels = [\"U\"]\n\n[streams.V]\nsid = \"string\"\nbp = \"float\"\n", ":6: [streams.V] bp: unknown type 'float'"),
        ("[lattice]\nlevels = [\"U\"]\n[streams.V]\nlevel = \"string\"\n", "system attribute"),
        ("[lattice]\nlevels = [\"U\"]\n[streams.V]\n", "declare at least one attribute"),
        ("[lattice]\nlevels = [\"U\"]\n[time]\ninstant_seconds = 0\n", ":4: [time] instant_seconds"),
        ("[lattice]\nlevels = [\"U\"]\n[bogus]\nx = 1\n", ":3: unknown section [bogus]"),
        ("[lattice\nlevels = 1\n", "invalid TOML"),
    ],
)
def test_invalid_configs_name_line_and_key(text, fragment):
    with pytest.raises(ConfigError) as e:
        parse_config(text)
    assert fragment in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.toml")


def test_users_path_next_to_config(tmp_path):
    p = tmp_path / "deploy.toml"
    p.write_text('[lattice]\nlevels = ["U"]\n')
    assert load_config(p).users_path == tmp_path / "deploy.users.json"


def test_example_files_match_the_packaged_examples():
    from strata.examples import AUDIT_TOML, BATTLEFIELD_TOML

    root = Path(__file__).resolve().parent.parent / "examples"
    assert (root / "battlefield.toml").read_text() == BATTLEFIELD_TOML
    assert (root / "audit.toml").read_text() == AUDIT_TOML
    parse_config(BATTLEFIELD_TOML)
    parse_config(AUDIT_TOML)


def test_sharing_section_is_checked():
    from strata.config import ConfigError, parse_config
    from strata.examples import BATTLEFIELD_TOML

    cfg = parse_config(BATTLEFIELD_TOML + "\n[sharing]\nenabled = false\n")
    assert (cfg.sharing.enabled, cfg.sharing.mode) == (False, "replicated")
    for bad, msg in (('enabled = "no"', "true or false"), ('mode = "shared"', "replicated"), ("x = 1", "unknown key")):
        with pytest.raises(ConfigError, match=msg):
            parse_config(BATTLEFIELD_TOML + f"\n[sharing]\n{bad}\n")


# ---- [limits] ------------------------------------------------------------------------------
def test_limits_defaults_and_values():
    from strata.examples import BATTLEFIELD_TOML

    d = parse_config(BATTLEFIELD_TOML).limits
    assert (d.max_ts, d.advance_horizon) == (2**53 - 1, 3600)
    cfg = parse_config(BATTLEFIELD_TOML + "\n[limits]\nmax_ts = 1_000_000\nadvance_horizon = 0\n")
    assert (cfg.limits.max_ts, cfg.limits.advance_horizon) == (1_000_000, 0)
    assert parse_config(BATTLEFIELD_TOML + "\n[limits]\nadvance_horizon = 60\n").limits.max_ts == 2**53 - 1


@pytest.mark.parametrize(
    "body, fragment",
    [
        ("max_ts = 0", ":4: [limits] max_ts: must be an integer from 1 to 4611686018427387903"),
        ("max_ts = 4611686018427387904", ":4: [limits] max_ts: must be an integer"),
        ("max_ts = 1.5", ":4: [limits] max_ts: must be an integer"),
        ("max_ts = true", ":4: [limits] max_ts: must be an integer"),
        ('max_ts = "9"', ":4: [limits] max_ts: must be an integer"),
        ("advance_horizon = -1", ":4: [limits] advance_horizon: must be an integer from 0"),
        ("max_rows = 3", ":4: [limits] max_rows: unknown key (expected one of max_ts, advance_horizon, "),
        ("result_retention_rows = -1", ":4: [limits] result_retention_rows: must be an integer from 0"),
    ],
)
def test_limits_errors_name_line_and_key(body, fragment):
    with pytest.raises(ConfigError) as e:
        parse_config(f'[lattice]\nlevels = ["U"]\n[limits]\n{body}\n')
    assert fragment in str(e.value)
    with pytest.raises(ConfigError, match=r"\[limits\]: must be a table"):
        parse_config('limits = 3\n[lattice]\nlevels = ["U"]\n')
