"""The ``supernode`` wrapper passes --data-dir / --cache-dir on to the SuperNode it starts (in-process, no Flower).

Before, they were only used for the dataset check and the printed ``flower-supernode`` command lost them, while the
README example showed ``--data-dir`` as if it configured the node.
"""

from __future__ import annotations

import shlex

import pytest

from fedrec_flwr.app.runtime import DATA_DIR_ENV
from fedrec_flwr.launch import supernode

NODE = ["--partition-id", "0", "--num-partitions", "3", "--users-per-node", "315", "--dataset", "ml-100k"]


def test_dry_run_prints_the_data_and_cache_folders_as_the_nodes_environment(ml100k_dir, tmp_path, capsys):
    code = supernode.supernode_main(
        [*NODE, "--data-dir", str(ml100k_dir), "--cache-dir", str(tmp_path / "cache"), "--insecure", "--dry-run"]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    words = shlex.split(out)
    assert words[:2] == [
        f"{DATA_DIR_ENV}={ml100k_dir.resolve()}",
        f"FEDREC_FLWR_CACHE={(tmp_path / 'cache').resolve()}",
    ]
    assert words[2].endswith("flower-supernode")
    assert words[3:] == ["--insecure", "--node-config", "partition-id=0 num-partitions=3"]
    assert f"{DATA_DIR_ENV}={ml100k_dir.resolve()}" in err and "users 0..314" in err


def test_started_supernode_gets_the_data_folder_in_its_environment(ml100k_dir, tmp_path, monkeypatch):
    started = {}

    def fake_execve(path, argv, env):
        started.update(path=path, argv=argv, env=env)

    monkeypatch.setattr(supernode, "check_superlink_listening", lambda address, timeout: None)
    monkeypatch.setattr(supernode.os, "execve", fake_execve)
    monkeypatch.chdir(ml100k_dir.parent)
    code = supernode.supernode_main(
        [
            *NODE,
            "--data-dir",
            ml100k_dir.name,
            "--cache-dir",
            str(tmp_path / "cache"),
            "--superlink",
            "127.0.0.1:1",
            "--insecure",
        ]
    )
    assert code == 0
    assert started["env"][DATA_DIR_ENV] == str(ml100k_dir.resolve())  # absolute: relative paths would break
    assert started["argv"][1:] == [
        "--superlink",
        "127.0.0.1:1",
        "--insecure",
        "--node-config",
        "partition-id=0 num-partitions=3",
    ]


def test_without_data_dir_nothing_is_added(capsys):
    assert supernode.supernode_main(["--partition-id", "1", "--num-partitions", "3", "--insecure", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert shlex.split(out)[0].endswith("flower-supernode") and DATA_DIR_ENV not in out


def test_help_says_which_flags_only_check_and_which_are_passed_on(capsys):
    with pytest.raises(SystemExit):
        supernode.supernode_main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--dataset DATASET", "--users-per-node USERS_PER_NODE", "--run-config RUN_CONFIG"):
        assert f"{flag} check only" in text
    assert "--data-dir DATA_DIR this node's dataset folder" in text and f"passed on as {DATA_DIR_ENV}=" in text
    assert "--cache-dir CACHE_DIR this node's processed-split cache" in text
    assert "passed on as FEDREC_FLWR_CACHE=" in text
