"""Bad input, config cases 5-8 (numbered across the tests/test_bad_input_*.py files): integer ranges, one place of
validation with kebab-case wording, round-timeout within Flower's message lifetime, and contradictory SuperNode
wrapper arguments."""

from __future__ import annotations

import dataclasses
import re
import socket

import pytest

from fedrec_flwr.config import INT_MAX, MESSAGE_TTL, RunConfig, default_mapping, make_run_config
from fedrec_flwr.errors import ConfigError

INT_KEYS = [f.metadata["key"] for f in dataclasses.fields(RunConfig) if f.metadata.get("key") and f.type == "int"]


def test_forget_users_beyond_a_c_long_is_a_config_error():
    """Case 5: ``forget-users = "10000000000000000000"`` ended in a raw OverflowError in strategies/unlearning.py."""
    with pytest.raises(
        ConfigError,
        match=r"'forget-users' = '10000000000000000000': user index "
        r"10000000000000000000 is out of range \(at most 2147483647\)",
    ):
        make_run_config(unlearning="retrain", forget_users="10000000000000000000")
    assert make_run_config(unlearning="retrain", forget_users=f"3,{INT_MAX}").forget_user_ids == (3, INT_MAX)


@pytest.mark.parametrize("key", INT_KEYS)
def test_every_integer_key_is_range_checked(key):
    """The kind of case 5: every integer key refuses a value no array index or seed can hold, naming the key."""
    assert len(INT_KEYS) >= 15
    mapping = default_mapping()
    mapping[key] = 10**19
    with pytest.raises(ConfigError, match=f"run-config key '{key}' = 10000000000000000000: must be <= "):
        RunConfig.from_mapping(mapping)


@pytest.mark.parametrize("key", INT_KEYS)
def test_every_integer_key_refuses_a_float_even_an_integral_one(key):
    """A new user's finding: ``num-server-rounds = 10.0`` (or ``1e9``, a TOML float) was silently taken as the integer
    10. Now every integer key refuses any float, naming the key and the value and, for an integral one, the integer
    to write; the default's own value as an int still passes."""
    mapping = default_mapping()
    default = mapping[key]
    assert type(default) is int  # pyproject.toml declares every integer key's default as an integer
    with pytest.raises(ConfigError) as caught:
        RunConfig.from_mapping({**mapping, key: float(default)})
    assert str(caught.value) == (
        f"run-config key '{key}' = {float(default)!r}: expected an integer, got the float "
        f"{float(default)!r}; write {default}"
    )
    with pytest.raises(
        ConfigError,
        match=rf"^run-config key '{key}' = {default + 0.5!r}: expected an integer, got "
        rf"the float {default + 0.5!r}$",
    ):
        RunConfig.from_mapping({**mapping, key: default + 0.5})
    assert getattr(RunConfig.from_mapping(mapping), key.replace("-", "_")) == default


@pytest.mark.parametrize("key", INT_KEYS)
def test_every_integer_key_refuses_a_boolean(key):
    """``true`` is an ``int`` in Python (``True == 1``); an integer key refuses it, in TOML's spelling."""
    with pytest.raises(ConfigError, match=rf"^run-config key '{key}' = true: expected an integer, got a boolean$"):
        RunConfig.from_mapping({**default_mapping(), key: True})


@pytest.mark.parametrize("key", ["ks", "mlp-layers"])
def test_integer_lists_are_range_checked(key):
    with pytest.raises(
        ConfigError, match=f"run-config key '{key}' = '8,10000000000000000000': every value must be <= {INT_MAX}"
    ):
        make_run_config(**{key: "8,10000000000000000000"})


@pytest.mark.parametrize("key", ["ks", "mlp-layers"])
def test_an_integer_list_given_as_a_toml_array_names_the_string_form(key):
    with pytest.raises(
        ConfigError,
        match=rf"run-config key '{key}' = '\[5, 10\]': expected comma-separated integers "
        rf"in one string, e.g. {key}=\"5,10\"",
    ):
        make_run_config(**{key: "[5, 10]"})


def test_forget_users_given_as_a_toml_array_in_a_string_names_the_string_form():
    """``--run-config 'forget-users="[3,17]"'`` (a fresh user's try: the README says values are TOML)."""
    with pytest.raises(
        ConfigError,
        match=r"'forget-users' = '\[3,17\]': expected comma-separated user indices in one "
        r"string, e.g. forget-users=\"3,17\" \(--run-config\) or forget-users=3,17 "
        r"\(the launcher\); not a TOML array",
    ):
        _ = make_run_config(unlearning="retrain", forget_users="[3,17]").forget_user_ids


@pytest.mark.parametrize("key", ["ks", "mlp-layers", "forget-users"])
def test_a_list_value_names_the_one_string_form(key):
    """A TOML array given to the launcher (``forget-users=[3,17]``) arrives as a Python list, which Flower's run
    config cannot hold: refused naming the key, the value and the string to write instead."""
    with pytest.raises(
        ConfigError,
        match=rf"run-config key '{key}' = \[3, 17\]: expected a string; write the list "
        rf"as one string, {key} = \"3,17\"",
    ):
        make_run_config(**{key: [3, 17]})


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"min_user_interactions": 1}, "'min-user-interactions' = 1: must be >= 2"),
        (
            {"min_user_interactions": 2, "holdout_validation": True},
            "'min-user-interactions' = 2: must be >= 3 .*holdout-validation = true",
        ),
        (
            {"dataset": "generic", "generic_file": "x.csv", "generic_columns": "user"},
            "'generic-columns' = 'user': give",
        ),
        (
            {"dataset": "generic", "generic_file": "x.csv", "generic_columns": "u,i,,u"},
            "'generic-columns' = 'u,i,,u': a column is named twice",
        ),
        ({"device": "cuda:x"}, "'device' = 'cuda:x': must be cpu, cuda, cuda:N or auto"),
        ({"generic_file": "x.csv"}, "'generic-file' is set but dataset = 'ml-100k' does not read it"),
    ],
)
def test_checks_a_config_can_fail_are_in_run_config_validation(overrides, message):
    """Case 6 and its kind: refused when the config is validated, naming the kebab-case key the user wrote."""
    with pytest.raises(ConfigError, match=message) as caught:
        make_run_config(**overrides)
    assert "run-config key '" in str(caught.value)
    assert not re.search(r"\b(min_user_interactions|data_dir|generic_columns)\b", str(caught.value))


def test_paths_are_checked_by_run_config_where_the_data_is_read(tmp_path):
    """Case 6: ``data-dir '/nonexistent'`` was refused by the loader in snake case; now by RunConfig.check_files,
    which every process that reads the data runs first (the ServerApp never reads it)."""
    from fedrec_flwr.app.runtime import load_split_for

    config = make_run_config(data_dir=str(tmp_path / "nonexistent"))
    with pytest.raises(ConfigError, match=r"run-config key 'data-dir' = '.*nonexistent': no such folder"):
        load_split_for(config)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"run-config key 'data-dir' = '.*file' is a file"):
        make_run_config(data_dir=str(tmp_path / "file")).check_files()
    with pytest.raises(ConfigError, match=r"run-config key 'cache-dir' = '.*file' is a file, not a folder"):
        make_run_config(cache_dir=str(tmp_path / "file")).check_files()
    generic = make_run_config(
        dataset="generic", generic_file=str(tmp_path / "file"), generic_attributes_file="nope.csv"
    )
    with pytest.raises(
        ConfigError,
        match=r"run-config key 'generic-attributes-file' = 'nope.csv': file 'nope.csv' "
        "not found",
    ):
        generic.check_files()
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"run-config key 'device' = 'cuda:0': this machine has 0 CUDA device"):
            make_run_config(device="cuda:0").check_files()


def test_round_timeout_may_not_outlive_flowers_messages():
    """Case 7: flwr 1.42 gives each message ``flwr.app.DEFAULT_TTL`` = 12 hours."""
    from flwr.app import DEFAULT_TTL

    assert MESSAGE_TTL == DEFAULT_TTL == 43200
    assert make_run_config(round_timeout=43200.0).round_timeout == 43200.0
    with pytest.raises(ConfigError, match=r"run-config key 'round-timeout' = 43201.0: must be <= 43200.0"):
        make_run_config(round_timeout=43201.0)


@pytest.fixture
def listening_port():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    yield server.getsockname()[1]
    server.close()


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--partition-id", "0", "--node-config", "partition-id=1 num-partitions=3"],
            r"'partition-id' is given twice with different values: 1 \(--node-config 'partition-id=1 num-partitions=3'\) "
            r"and 0 \(--partition-id 0\)",
        ),
        (
            ["--num-partitions", "4", "--node-config", "partition-id=1 num-partitions=3"],
            "'num-partitions' is given twice with different values: 3 .* and 4",
        ),
        (
            ["--node-config", "partition-id=1 num-partitions=3", "--node-config", "partition-id=2"],
            "'partition-id' is given twice with different values: 1 .* and 2",
        ),
        (
            ["--node-config", "partition-id=1 num-partitions=3 partition-id=2"],
            "'partition-id' is given twice with different values: 1 .* and 2",
        ),
        (
            [
                "--partition-id",
                "0",
                "--num-partitions",
                "2",
                "--dataset",
                "filmtrust",
                "--run-config",
                "dataset='ml-100k'",
            ],
            "'dataset' is given twice with different values: 'ml-100k' .* and 'filmtrust'",
        ),
        (
            [
                "--partition-id",
                "0",
                "--num-partitions",
                "2",
                "--users-per-node",
                "3",
                "--run-config",
                "users-per-node=4",
            ],
            "'users-per-node' is given twice with different values: 4 .* and 3",
        ),
        (
            ["--partition-id", "0", "--num-partitions", "2", "--superlink", "127.0.0.1:1", "--superlink=127.0.0.1:2"],
            "'--superlink' is given twice with different values",
        ),
    ],
)
def test_the_supernode_wrapper_refuses_contradictory_values(argv, message, capsys):
    """Case 8: ``--partition-id 0 --node-config "partition-id=1 ..."`` silently used 0."""
    from fedrec_flwr.launch.supernode import supernode_main

    assert supernode_main([*argv, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


def test_the_supernode_wrapper_accepts_the_same_value_twice(listening_port, capsys):
    from fedrec_flwr.launch.supernode import supernode_main

    address = f"127.0.0.1:{listening_port}"
    argv = [
        "--partition-id",
        "1",
        "--num-partitions",
        "3",
        "--node-config",
        "partition-id=1 num-partitions=3",
        "--superlink",
        address,
        "--superlink",
        address,
        "--dry-run",
    ]
    assert supernode_main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("--superlink") == 1 and "partition-id=1 num-partitions=3" in out


def test_supernode_dry_run_prints_the_command_without_probing_the_superlink(capsys):
    """``--dry-run`` checks the node config and prints the command; it does not need a SuperLink to be up."""
    from fedrec_flwr.launch.supernode import supernode_main

    assert (
        supernode_main(
            ["--partition-id", "0", "--num-partitions", "3", "--superlink", "127.0.0.1:9", "--insecure", "--dry-run"]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert "--superlink 127.0.0.1:9" in captured.out and "partition-id=0 num-partitions=3" in captured.out
    assert "not probed: --dry-run" in captured.err
