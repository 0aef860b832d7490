"""docs/reference/run-config.md is generated from pyproject.toml's [tool.flwr.app.config] and RunConfig, and is
current; every key appears with its default, type and allowed values."""

from __future__ import annotations

import tomllib

import pytest
from conftest import PROJECT_ROOT

from fedrec_flwr import config_reference
from fedrec_flwr.config import RunConfig
from fedrec_flwr.errors import ConfigError

PAGE = PROJECT_ROOT / "docs" / "reference" / "run-config.md"


def test_the_committed_reference_page_is_current():
    assert PAGE.read_text(encoding="utf-8") == config_reference.render(), (
        "docs/reference/run-config.md is stale: python -m fedrec_flwr.config_reference --write "
        "docs/reference/run-config.md"
    )
    assert config_reference.main(["--check", str(PAGE)]) == 0


def test_every_key_appears_with_its_default():
    defaults = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    page = PAGE.read_text(encoding="utf-8")
    assert [e.name for e in config_reference.entries()] == list(defaults)
    for key, value in defaults.items():
        entry = config_reference.entry(key)
        assert tomllib.loads(f"v = {entry.default}")["v"] == value, key
        assert f"| `{key}` | {entry.type} | `{entry.default.replace('|', chr(92) + '|')}` |" in page, key


def test_one_entry_gives_type_default_meaning_and_allowed_values():
    entry = config_reference.entry("krylov-solver")
    assert (entry.name, entry.type, entry.default, entry.allowed) == (
        "krylov-solver",
        "string",
        '"steihaug"',
        ("steihaug", "cg"),
    )
    assert (
        entry.meaning.startswith("hfkcu:")
        and entry.group == "client unlearning (HF-KCU and its baselines; strategies item-fedavg and server-optimizer)"
    )
    fraction = config_reference.entry("fraction-train")
    assert (fraction.type, fraction.default, fraction.bounds) == ("float", "0.1", "0 < x <= 1")
    assert "fraction-train = 0.1" in fraction.as_text()
    with pytest.raises(ConfigError, match="'no-such-key' is not a run-config key"):
        config_reference.entry("no-such-key")


def test_a_stale_page_and_an_undocumented_key_are_caught(tmp_path, capsys):
    stale = tmp_path / "run-config.md"
    stale.write_text(
        PAGE.read_text(encoding="utf-8").replace("| `seed` | integer | `0` |", "| `seed` | integer | `1` |")
    )
    assert config_reference.main(["--check", str(stale)]) == 1
    assert "is stale" in capsys.readouterr().err
    text = (PROJECT_ROOT / "pyproject.toml").read_text(encoding="utf-8")
    bare = tmp_path / "pyproject.toml"
    bare.write_text(text.replace("seed = 0                         # fixes the split", "seed = 0  #\n# fixes"))
    with pytest.raises(ConfigError, match="line .*: run-config key 'seed' has no comment"):
        config_reference.entries(bare)
    extra = tmp_path / "extra.toml"
    extra.write_text(text.replace("[tool.flwr.app.config]\n", "[tool.flwr.app.config]\nnew-key = 1  # new\n"))
    with pytest.raises(ConfigError, match="'new-key' is not a field of fedrec_flwr.config.RunConfig"):
        config_reference.entries(extra)
    assert len(config_reference.entries()) == len(
        [f for f in RunConfig.__dataclass_fields__.values() if f.metadata.get("key")]
    )


def test_a_hash_inside_a_quoted_default_is_part_of_the_value():
    from fedrec_flwr.config_reference import _split_comment

    assert _split_comment('name = "a # b"   # what # it is') == ('name = "a # b"', "what # it is")
    assert _split_comment("n = 3") == ("n = 3", "")
