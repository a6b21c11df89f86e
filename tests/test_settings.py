"""One typed configuration, parsed and checked once (issue 32).

Every setting is declared once (strata/config.py: :data:`OPTIONS`, the fields of the sections'
frozen dataclasses and :data:`CHUNK_SECONDS`); these tests are driven by those declarations: each
option's default, each value its check refuses (one line naming file, line, key and the rule), an
unknown key per section; then typed access (``config.cluster.heartbeat_seconds``,
``config.group("S").spark``, ``config.sharing.enabled``), and the chunk length: a positive whole
multiple of ``[time] instant_seconds``, refused with one line (never clamped) by the helper, the
CLI's flag, the commands that start masters and an inventory.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from strata.cli_support import chunk_seconds_arg
from strata.config import (CHUNK_RULE, CHUNK_SECONDS, OPTIONS, SECTIONS, ClusterSettings, ConfigError, GroupSettings,
                           Limits, SharingSettings, TimeSettings, chunk_instants, default_group_address, load_config,
                           parse_config)
from strata.spark_settings import SparkSettings

from .conftest import BATTLEFIELD_TOML

BASE = '[lattice]\nlevels = ["U", "C", "S", "TS"]\n'
#: how a test writes each section's table (a level's group: S's)
TABLE = {"time": "time", "limits": "limits", "cluster": "cluster", "sharing": "sharing", 'groups."L"': 'groups."S"'}
SECTION_OPTIONS = [o for o in OPTIONS if o.section]


def toml(value) -> str:
    """``value`` as a TOML literal."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    return "[" + ", ".join(toml(v) for v in value) + "]"


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "strata.toml"
    p.write_text(text)
    return p


def section_object(cfg, section: str):
    """The typed object of ``section`` in ``cfg`` (a level's group as the file sets it)."""
    if section == 'groups."L"':
        return cfg.groups.get("S") or GroupSettings(level="S")
    return {"time": cfg.time, "limits": cfg.limits, "cluster": cfg.cluster, "sharing": cfg.sharing}[section]


# ---- the declarations ---------------------------------------------------------------------------------
def test_every_option_is_declared_once_with_a_doc_and_a_check():
    names = [(o.section, o.name) for o in OPTIONS]
    assert len(names) == len(set(names))
    assert set(SECTIONS) == set(TABLE)
    for o in OPTIONS:
        assert o.doc.strip() and "\n" not in o.doc, o.where
        assert o.check.rule.startswith("must "), o.where
        assert o.check.bad, f"{o.where}: no refused sample"


@pytest.mark.parametrize("o", SECTION_OPTIONS, ids=lambda o: o.where)
def test_every_default(o):
    """A configuration without the key has the declared default (the dataclass's own is the same value)."""
    cfg = parse_config(BASE)
    assert getattr(section_object(cfg, o.section), o.name) == o.default
    assert getattr(SECTIONS[o.section](), o.name) == o.default


@pytest.mark.parametrize("o, bad", [(o, bad) for o in SECTION_OPTIONS for bad in o.check.bad],
                         ids=lambda x: x.where if hasattr(x, "where") else repr(x))
def test_every_check_refuses_in_one_line_naming_file_line_and_key(tmp_path, o, bad):
    p = write(tmp_path, BASE + f"[{TABLE[o.section]}]\n{o.name} = {toml(bad)}\n")
    with pytest.raises(ValueError) as want:
        o.check.parse(bad)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert isinstance(e.value, o.check.error)
    assert str(e.value) == f"{p}:4: [{TABLE[o.section]}] {o.name}: {want.value}"
    if not o.check.ok(bad):  # the wrong kind of value: the rule itself is the message
        assert str(want.value) == o.check.rule


@pytest.mark.parametrize("section", sorted(TABLE))
def test_unknown_keys_are_refused_in_one_line(tmp_path, section):
    p = write(tmp_path, BASE + f"[{TABLE[section]}]\nbogus = 1\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}:4: [{TABLE[section]}] bogus: unknown key (expected ") and "\n" not in msg
    for o in options_of_section(section):
        assert o.name in msg


def options_of_section(section: str):
    return [o for o in SECTION_OPTIONS if o.section == section]


def test_sections_must_be_tables_and_unused_sections_are_unknown():
    for section in ("time", "limits", "cluster", "sharing"):
        with pytest.raises(ConfigError, match=rf"\[{section}\]: must be a table"):
            parse_config(f"{section} = 3\n" + BASE)
    with pytest.raises(ConfigError, match=r"\[groups\]: must be a table of per-level tables"):
        parse_config("groups = 3\n" + BASE)
    with pytest.raises(ConfigError, match=r'\[groups."S"\]: must be a table'):
        parse_config(BASE + '[groups]\nS = 3\n')
    for never_read in ("tls", "security"):
        with pytest.raises(ConfigError, match=rf":3: unknown section \[{never_read}\]"):
            parse_config(BASE + f"[{never_read}]\nx = 1\n")


def test_a_groups_table_names_one_level_once():
    with pytest.raises(ConfigError) as e:
        parse_config(BASE + '[groups."Q"]\nport = 47001\n')
    assert str(e.value).startswith("<config>:3: [groups.\"Q\"]: unknown level 'Q'")
    with pytest.raises(ConfigError) as e:  # " S" is level S too
        parse_config(BASE + '[groups."S"]\nport = 47001\n[groups." S"]\nttl = 1\n')
    assert str(e.value) == '<config>:5: [groups." S"]: level S already has its table, [groups."S"]'


def test_the_example_files_and_the_spark_keys_still_load():
    root = Path(__file__).resolve().parent.parent / "examples"
    for f in ("battlefield.toml", "audit.toml"):
        load_config(root / f)
    with pytest.raises(ConfigError, match=r":4: \[groups.\"S\"\] spark_masterr: unknown key \(the Spark keys of a "
                                          r"level: spark_master, spark_conf, spark_secret_file\)"):
        parse_config(BASE + '[groups."S"]\nspark_masterr = "local"\n')


def test_the_documented_reference_loads_and_names_every_option():
    readme = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    part = readme[readme.index("# Configuration reference"):]
    block = part[part.index("```toml") + len("```toml"):]
    block = block[:block.index("```")]
    cfg = parse_config(block)
    assert cfg.group("S").cpus == frozenset({2, 3}) and cfg.group("S").spark.master == "spark://10.0.0.7:7077"
    for o in SECTION_OPTIONS:
        assert f"\n{o.name} = " in block or f"\n# {o.name} = " in block, f"docs/configuration.md does not show {o.where}"


# ---- typed access -------------------------------------------------------------------------------------
def test_typed_access(tmp_path):
    key = tmp_path / "S.key"
    cfg = parse_config(BATTLEFIELD_TOML + """
[time]
instant_seconds = 0.5

[cluster]
heartbeat_seconds = 0.02
multicast_port = 47100
interface = "10.0.0.5"
load_reading = "process"
dispatch_linger = false

[sharing]
enabled = false
mode = "trusted"

[limits]
max_ts = 1000

[groups."S"]
port = 47003
ttl = 1
key_file = "S.key"
cpus = "0-1,3"
masters = ["10.0.0.5:7100", "10.0.0.6:7100"]
ray_port = 50000
spark_master = "local[2]"
spark_conf = { "spark.executor.memory" = "1g" }

[groups.TS]
address = "239.255.10.4"
masters = "10.0.0.7:7100,10.0.0.8:7100"
""", path=tmp_path / "strata.toml")
    assert cfg.instant_seconds == 0.5 and cfg.time == TimeSettings(0.5)
    assert cfg.cluster == ClusterSettings(load_reading="process", multicast_port=47100, heartbeat_seconds=0.02,
                                          interface="10.0.0.5", multicast_ttl=0, dispatch_linger=False)
    assert (cfg.sharing.enabled, cfg.sharing.mode) == (False, "trusted")
    assert cfg.limits == replace(Limits(), max_ts=1000)
    assert set(cfg.groups) == {"S", "TS"}  # as the file sets them: unset options are None
    s = cfg.groups["S"]
    assert (s.address, s.interface, s.port, s.ttl) == (None, None, 47003, 1)
    g = cfg.group("S")  # defaults filled in
    assert (g.address, g.port, g.interface, g.ttl) == (default_group_address("S"), 47003, "10.0.0.5", 1)
    assert g.cpus == frozenset({0, 1, 3}) and g.masters == ("10.0.0.5:7100", "10.0.0.6:7100")
    assert g.ray_port == 50000 and g.ray_address is None and g.key is None
    assert g.key_file == "S.key" and g.key_path(cfg.path) == key
    assert g.spark == SparkSettings(level="S", master="local[2]", conf={"spark.executor.memory": "1g"},
                                    source="config")
    ts = cfg.group("ts".upper())
    assert (ts.address, ts.port, ts.ttl, ts.masters) == ("239.255.10.4", 47100, 0, ("10.0.0.7:7100", "10.0.0.8:7100"))
    u = cfg.group("U")  # no table: every default
    assert u == GroupSettings(level="U", address=default_group_address("U"), port=47100, interface="10.0.0.5", ttl=0)
    assert u.spark == SparkSettings(level="U") and u.cpus is None and u.masters == ()
    assert cfg.cluster.reading() == "process" and ClusterSettings().reading() == "host"
    assert ClusterSettings().reading(embedded=True) == "process"
    with pytest.raises(ValueError):
        cfg.group("Q")


def test_roles_read_the_typed_values(tmp_path):
    from strata.groups import group_spec
    from strata.sharing import sharing_enabled, sharing_mode

    cfg = parse_config(BATTLEFIELD_TOML + '\n[cluster]\nheartbeat_seconds = 0.02\n[sharing]\nmode = "trusted"\n'
                       '[groups."S"]\nport = 47003\nkey = "' + "ab" * 16 + '"\n')
    spec = group_spec(cfg, "S")
    assert (spec.port, spec.interval, spec.key, spec.address) == (47003, 0.02, bytes.fromhex("ab" * 16),
                                                                   default_group_address("S"))
    assert sharing_enabled(cfg) is True and sharing_mode(cfg) == "trusted"
    assert not sharing_enabled(replace(cfg, sharing=SharingSettings(enabled=False)))


# ---- the chunk length ---------------------------------------------------------------------------------
def test_chunk_seconds_is_declared_once():
    assert CHUNK_SECONDS.name == "chunk_seconds" and CHUNK_SECONDS.default is None  # None: one instant
    assert CHUNK_SECONDS.check.rule == CHUNK_RULE
    assert CHUNK_RULE == ("must be a positive whole multiple of [time] instant_seconds (a chunk is 1, 2, 3, ... "
                          "instants)")


@pytest.mark.parametrize("seconds, instants", [(None, 1), (1.0, 1), (2, 2), (4, 4), (4.0, 4)])
def test_chunk_lengths_accepted(seconds, instants):
    assert chunk_instants(seconds, 1.0) == instants


@pytest.mark.parametrize("seconds", [0, -3, 0.3, 1.5, math.nan, math.inf, True])
def test_chunk_lengths_refused_not_clamped(seconds):
    with pytest.raises(ValueError) as e:
        chunk_instants(seconds, 1.0)
    assert str(e.value).startswith(CHUNK_RULE) and "\n" not in str(e.value)


def test_chunk_lengths_follow_the_instant():
    assert chunk_instants(1.0, 0.5) == 2 and chunk_instants(0.3, 0.1) == 3 and chunk_instants(60, 30) == 2
    with pytest.raises(ValueError, match=r"instant_seconds is 0.5 here"):
        chunk_instants(0.75, 0.5)
    with pytest.raises(ValueError, match=r"instant_seconds is 30 here"):
        chunk_instants(1.0, 30)


def test_the_flag_refuses_what_is_not_a_positive_number():
    assert chunk_seconds_arg("2") == 2.0 and chunk_seconds_arg("0.3") == 0.3  # 0.3: refused with the config
    for text in ("0", "-3", "nan", "inf", "one"):
        with pytest.raises(argparse.ArgumentTypeError) as e:
            chunk_seconds_arg(text)
        assert CHUNK_RULE in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("command", [
    ["master", "--config", "{cfg}", "--level", "S", "--insecure"],
    ["up", "--config", "{cfg}", "--levels", "S", "--state-dir", "{state}"],
    ["replay", "--config", "{cfg}", "--user", "u", "--level", "S", "--query", "SELECT bp FROM Vitals [NOW]",
     "--input", "Vitals={cfg}", "--output", "{state}/out"],
])
@pytest.mark.parametrize("seconds", ["0", "-3", "0.3"])
def test_the_commands_refuse_a_bad_chunk_length_in_one_line_before_anything_starts(tmp_path, capsys, command,
                                                                                    seconds):
    from strata.cli import main

    cfg = write(tmp_path, BATTLEFIELD_TOML)
    state = tmp_path / "state"
    argv = [a.format(cfg=cfg, state=state) for a in command] + [f"--chunk-seconds={seconds}"]
    if seconds == "0.3":  # a positive number: refused once the configuration gives the instant
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"strata: --chunk-seconds 0.3: {CHUNK_RULE}; instant_seconds is 1 here"
    else:
        with pytest.raises(SystemExit) as e:  # argparse: its usage, then the one line
            main(argv)
        assert e.value.code == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.endswith(f"error: argument --chunk-seconds: {seconds}: {CHUNK_RULE}")
    assert not state.exists()  # nothing started


def test_an_inventory_refuses_a_bad_chunk_length(tmp_path):
    from strata.deploy.inventory import InventoryError, load_inventory

    (tmp_path / "strata.toml").write_text(BATTLEFIELD_TOML)
    inv = tmp_path / "inventory.toml"

    def load(line: str):
        inv.write_text(f'[deployment]\nconfig = "strata.toml"\ntransport = "local"\nstate_dir = "/tmp/x"\n{line}\n'
                       f'[[hosts]]\nname = "h"\naddress = "127.0.0.1"\nlevels = {{ S = {{ master = true, workers = 1 }} }}\n')
        return load_inventory(inv)

    assert load("").chunk_seconds == 1.0  # one instant
    assert load("chunk_seconds = 2").chunk_seconds == 2.0
    for bad in ("0", "-3", "0.3", '"1"'):
        with pytest.raises(InventoryError) as e:
            load(f"chunk_seconds = {bad}")
        assert str(e.value).startswith(f"inventory deployment.chunk_seconds: {CHUNK_RULE}") and "\n" not in str(e.value)
