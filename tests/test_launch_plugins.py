"""Plug-ins from the documented place (`plugins/`, shipped with the app) with their own run-config keys: declared by
the class, validated, carried through Flower's `--run-config` (packed into `plugin-config`), recorded in config.json,
and used by the run. The real `flwr run` of a plug-in is in tests/test_launch_real_runs.py."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
from conftest import tiny_run_config
from flwr.common.config import parse_config_args

from fedrec_flwr.config import RunConfig, default_mapping, make_run_config
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.launch import check_shipped, run_config_args, shipped_files
from fedrec_flwr.registry import check_components

PLUGIN = "plugins.server_lr:ServerLrItemFedAvg"


def test_plugins_folder_ships_with_the_app():
    assert {"plugins/__init__.py", "plugins/server_lr.py"} <= set(shipped_files())


def test_plugin_keys_are_declared_validated_and_defaulted():
    assert make_run_config(strategy=PLUGIN).extra == {"server-lr": 0.5}
    assert make_run_config(strategy=PLUGIN, **{"server-lr": 0.3}).extra == {"server-lr": 0.3}
    with pytest.raises(ConfigError, match="'server-lr' = 'fast': expected a number"):
        make_run_config(strategy=PLUGIN, **{"server-lr": "fast"})
    with pytest.raises(ConfigError, match=r"'server-lr' = 3.0: must be in \(0, 1\]"):
        check_components(make_run_config(strategy=PLUGIN, **{"server-lr": 3.0}))
    with pytest.raises(ConfigError, match=r"unknown run-config key\(s\) \['server-lr'\]"):
        make_run_config(**{"server-lr": 0.3})  # the built-in strategy declares no such key
    with pytest.raises(ConfigError, match=r"names \['speed'\], which no configured plug-in declares"):
        make_run_config(strategy=PLUGIN, plugin_config="speed=1")


def test_plugin_keys_travel_through_flowers_run_config_exactly():
    """What Flower's parser makes of the launcher's `--run-config` validates to the same plug-in values."""
    overrides = {"strategy": PLUGIN, "server-lr": 0.3, "run-name": 'o\'brien "x" \\ ü'}
    parsed = parse_config_args([run_config_args(overrides)[1]])
    assert "server-lr" not in parsed and parsed["plugin-config"] == "server-lr=0.3"
    config = RunConfig.from_mapping({**default_mapping(), **parsed})
    assert config.extra == {"server-lr": 0.3} and config.run_name == overrides["run-name"]
    nested = run_config_args({"odd": "a'b\"c\\d é"}, declared=["plugin-config"])  # a string plug-in value, twice quoted
    inner = parse_config_args([nested[1]])["plugin-config"]
    assert parse_config_args([inner]) == {"odd": "a'b\"c\\d é"}


def test_a_module_the_app_does_not_ship_is_refused_with_the_fix(tmp_path, monkeypatch):
    (tmp_path / "pyproject.toml").write_text('[tool.flwr.app]\nfab-include = ["/pyproject.toml", "shipped/*.py"]\n')
    (tmp_path / "shipped").mkdir()
    (tmp_path / "shipped" / "one_strategy.py").write_text("class S:\n    pass\n")
    (tmp_path / "my_strategy_at_root.py").write_text("class MyStrategy:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = types.SimpleNamespace(strategy="my_strategy_at_root:MyStrategy", client="fedrec")
    with pytest.raises(
        ConfigError, match=r"my_strategy_at_root.py is not shipped.*plugins\.my_strategy_at_root:MyStrategy"
    ):
        check_shipped(config, project=tmp_path)
    check_shipped(types.SimpleNamespace(strategy="shipped.one_strategy:S", client="fedrec"), project=tmp_path)


def test_plugin_strategy_with_its_own_key_runs_and_is_recorded(tmp_path):
    """In process (the serial grid): server-lr = 1 is exactly item-embedding FedAvg; 0.3 moves less; config.json
    records the value."""
    from fedrec_flwr.serial import run_serial

    def final(name, **more):
        folder = run_serial(tiny_run_config(tmp_path, run_name=name, num_server_rounds=2, **more))
        return folder, dict(np.load(folder / "final_arrays.npz"))

    _, plain = final("plain")
    _, full = final("full", strategy=PLUGIN, **{"server-lr": 1.0})
    folder, damped = final("damped", strategy=PLUGIN, **{"server-lr": 0.3})
    for key in plain:
        np.testing.assert_allclose(full[key], plain[key], rtol=0, atol=1e-6)
    assert any(not np.allclose(damped[k], plain[k]) for k in plain)
    assert json.loads((folder / "config.json").read_text())["run-config"]["server-lr"] == 0.3


def test_a_plugin_key_given_flat_or_packed_resumes_and_is_refused_when_given_twice_differently(tmp_path):
    """A launcher run of a plug-in records plugin-config = "server-lr=0.3" (how its key travels through flwr run),
    while the resuming command's preflight sees server-lr=0.3 and an empty plugin-config: the resume was refused as
    'other settings'. plugin-config is now compared through the keys it carries; a key given both ways with two
    values is refused before anything starts (it failed at round 0 with exit 1)."""
    from fedrec_flwr.state.checkpoint import Checkpoint, check_resumable

    launched = make_run_config(strategy=PLUGIN, plugin_config="server-lr=0.3").to_dict()
    resuming = make_run_config(strategy=PLUGIN, **{"server-lr": 0.3}).to_dict()
    checkpoint = Checkpoint(server_round=2, run_name="r", run_config=launched, arrays={}, folder=tmp_path)
    check_resumable(checkpoint, resuming)
    with pytest.raises(ConfigError, match=r"other settings \(server-lr: 0.3 -> 0.5\)"):
        check_resumable(checkpoint, make_run_config(strategy=PLUGIN, **{"server-lr": 0.5}).to_dict())

    both = {"strategy": PLUGIN, "plugin-config": "server-lr=0.3", "server-lr": 0.3}
    assert parse_config_args([run_config_args(both)[1]])["plugin-config"] == "server-lr=0.3"  # once, not twice
    assert make_run_config(**both).extra == {"server-lr": 0.3}
    for where in (
        lambda: run_config_args({**both, "server-lr": 0.5}),
        lambda: make_run_config(**{**both, "server-lr": 0.5}),
    ):
        with pytest.raises(
            ConfigError,
            match=r"run-config key 'server-lr' is given twice: server-lr=0.5 and in "
            r"plugin-config \(server-lr=0.3\)",
        ):
            where()


def test_a_plugin_check_config_that_raises_another_exception_is_one_config_error(monkeypatch):
    """A plug-in's check_config raising ValueError gave a launcher traceback and exit 1 ("the run started")."""
    from fedrec_flwr.strategies.item_fedavg import ItemEmbeddingFedAvg

    class Picky(ItemEmbeddingFedAvg):
        @classmethod
        def check_config(cls, config):
            raise ValueError("median-min-nodes must be >= 1")

    module = types.ModuleType("t_picky_strategy")
    module.Picky = Picky
    monkeypatch.setitem(__import__("sys").modules, "t_picky_strategy", module)
    with pytest.raises(
        ConfigError,
        match=r"strategy 't_picky_strategy:Picky' refused the run config in "
        r".*Picky.check_config: ValueError: median-min-nodes must be >= 1 \(a "
        r"check_config hook should raise fedrec_flwr.errors.ConfigError\)",
    ):
        check_components(make_run_config(strategy="t_picky_strategy:Picky"))
