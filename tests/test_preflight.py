"""Inputs that used to fail only after Flower had started (35-60 s, exit 1, the message printed 3-24 times) are refused
by one preflight (:mod:`fedrec_flwr.app.preflight`) before anything starts, through every entry point: the launcher's
command line (one ``error:`` line naming the key, exit 2, no Flower home, no results folder), ``run_serial`` (a
ConfigError before any message) and the ServerApp of a plain ``flwr run .`` (before any training message and before
the results folder is created). Tiny generated data; no Ray, no SuperLink."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import tiny_run_config
from flwr.app import Context, RecordDict

from fedrec_flwr import launch
from fedrec_flwr.app.preflight import preflight
from fedrec_flwr.config import default_mapping
from fedrec_flwr.errors import ConfigError

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

USERS_PER_NODE = 6  # the tiny dataset's 24 users on 4 nodes


def _with_attributes(tmp_path: Path) -> dict:
    """The tiny dataset with a ``gender`` attribute file."""
    path = tmp_path / "attributes.csv"
    path.write_text("user,gender\n" + "".join(f"u{u},{'MF'[u % 2]}\n" for u in range(24)))
    return {"generic-attributes-file": str(path)}


def _finished_run(tmp_path: Path) -> dict:
    (tmp_path / "results" / "done").mkdir(parents=True)
    (tmp_path / "results" / "done" / "summary.json").write_text("{}")
    return {"run-name": "done"}


def _empty_folder(tmp_path: Path) -> dict:
    (tmp_path / "interrupted").mkdir()
    return {"resume-from": str(tmp_path / "interrupted")}


def _results_dir_is_a_file(tmp_path: Path) -> dict:
    (tmp_path / "a-file").write_text("")
    return {"results-dir": str(tmp_path / "a-file")}


CASES = {
    "finished-run-name": (_finished_run, "'run-name' = 'done'"),
    "fedau2-without-attributes": (
        lambda _: {"client": "fedau2", "adversary": "mlp", "protected-attribute": "gender"},
        "'protected-attribute' = 'gender': the dataset 'generic' has no user attributes",
    ),
    "fedau2-unknown-attribute": (
        lambda p: {**_with_attributes(p), "client": "fedau2", "adversary": "mlp", "protected-attribute": "zodiac"},
        "'protected-attribute' = 'zodiac': the dataset's user attributes are ['gender']",
    ),
    "forget-users-out-of-range": (
        lambda _: {"unlearning": "retrain", "forget-users": "3,24"},
        "'forget-users' = '3,24': user index 24 is out of range",
    ),
    "resume-from-without-checkpoint": (_empty_folder, "'resume-from' = "),
    "fedprox-negative-mu": (
        lambda _: {"strategy": "flwr.serverapp.strategy:FedProx", "strategy-args": "proximal_mu=-0.1"},
        "sends 'proximal-mu' = -0.1: FedProx's proximal weight must be a finite number >= 0",
    ),
    "results-dir-is-a-file": (_results_dir_is_a_file, "'results-dir' = "),
}
"""Each case: (its overrides, made in ``tmp_path``; the text the error must hold, naming the key and the value)."""


def _config(tmp_path: Path, case: str) -> dict:
    make, _ = CASES[case]
    mapping = tiny_run_config(tmp_path, users_per_node=USERS_PER_NODE, run_name="fresh")
    mapping.update(make(tmp_path))
    return mapping


def _results_left(tmp_path: Path) -> list[str]:
    """What is under results-dir, the finished run's own files aside."""
    folder = tmp_path / "results"
    return (
        sorted(
            str(p.relative_to(folder))
            for p in folder.rglob("*")
            if p.parts[-2:] != ("done", "summary.json") and p != folder / "done"
        )
        if folder.is_dir()
        else []
    )


@pytest.mark.parametrize("case", CASES)
def test_the_launcher_refuses_before_anything_starts(tmp_path, capsys, case):
    """`python -m fedrec_flwr.launch run ...`: exit 2, one line naming the key and value; no Flower home (nothing
    started), no results folder."""
    mapping = _config(tmp_path, case)
    defaults = default_mapping(launch.PROJECT_ROOT / "pyproject.toml")
    pairs = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in mapping.items() if v != defaults.get(k)]
    code = launch.main(["run", "--flwr-home", str(tmp_path / "home"), *pairs])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: run-config key") and CASES[case][1] in lines[0], err
    assert not (tmp_path / "home").exists()
    assert _results_left(tmp_path) == []


@pytest.mark.parametrize("case", CASES)
def test_run_serial_refuses_before_the_first_message(tmp_path, case):
    """A Python snippet (`run_serial`, as the README shows it): the same ConfigError, before any message is sent and
    before the results folder is created."""
    from fedrec_flwr.serial import run_serial

    with pytest.raises(ConfigError, match=CASES[case][1].replace("[", r"\[").replace("]", r"\]")):
        run_serial(_config(tmp_path, case))
    assert _results_left(tmp_path) == []


@pytest.mark.parametrize("case", CASES)
def test_the_server_app_refuses_before_training_and_creates_no_folder(tmp_path, task_identity, case):
    """The ServerApp as a plain `flwr run .` runs it (it never reads the data): what needs no data is refused before
    any message; what needs the nodes' data (attributes, forget-users) after the identify query only. Either way
    before any training message, and no results folder."""
    from fedrec_flwr.app.client_app import make_client_app
    from fedrec_flwr.app.server_app import main
    from fedrec_flwr.serial import SerialGrid

    mapping = _config(tmp_path, case)
    grid = SerialGrid(make_client_app(mapping), 24 // USERS_PER_NODE, mapping)
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=mapping)
    with pytest.raises(ConfigError, match=CASES[case][1].replace("[", r"\[").replace("]", r"\]")):
        main(grid, context, mapping)
    # an attributes file's columns and the users' count are read by the nodes; 'generic' without an attributes
    # file is known to have no attributes from the run config alone
    needs_data = case in ("fedau2-unknown-attribute", "forget-users-out-of-range")
    assert grid.messages_delivered == (len(grid.contexts) if needs_data else 0)  # the identify query at most
    assert _results_left(tmp_path) == []


def test_preflight_creates_nothing_and_returns_what_the_run_uses(tmp_path):
    """A valid config passes; the results folder is named but not created, and the data half builds the runtime."""
    mapping = tiny_run_config(tmp_path, users_per_node=USERS_PER_NODE, run_name="fresh")
    plan = preflight(mapping, with_data=True)
    assert plan.folder == (tmp_path / "results" / "fresh").resolve() and not plan.folder.exists()
    assert plan.num_users == 24 and plan.resume is None
    assert preflight(mapping).runtime is None
    assert launch.check_run({k: v for k, v in mapping.items()}) == 4  # ceil(24 users / 6 per node)
    assert not (tmp_path / "results").exists()


def test_an_interrupted_runs_files_stay_until_the_run_starts(tmp_path):
    """The preflight only reads: an interrupted run's partial files under the same run-name are left for the
    ServerApp, which clears them when it starts (check_results_folder)."""
    mapping = tiny_run_config(tmp_path, users_per_node=USERS_PER_NODE, run_name="again")
    (tmp_path / "results" / "again").mkdir(parents=True)
    (tmp_path / "results" / "again" / "metrics.csv").write_text("round\n1\n")
    preflight(mapping, with_data=True)
    assert (tmp_path / "results" / "again" / "metrics.csv").is_file()


@pytest.mark.parametrize(
    ("dataset", "expected"),
    [
        (
            "ml-100k",
            "'protected-attribute' = 'zodiac': the dataset 'ml-100k''s user attributes are ['age', 'gender', 'occupation']",
        ),
        (
            "filmtrust",
            "'protected-attribute' = 'zodiac': the dataset 'filmtrust' has no user attributes "
            "(datasets with user attributes: 'ml-100k' (age, gender, occupation)",
        ),
    ],
)
def test_an_attribute_a_named_dataset_lacks_is_refused_alone_before_the_published_prior_warning(
    tmp_path, caplog, dataset, expected
):
    """FedAU² with ``adversary-class-prior = "published"`` (the default) and an attribute the dataset lacks first
    warned that the published prior falls back to none for it, then refused the attribute (a fresh user's finding).
    A named dataset's attributes are known without its files, so the run config refuses it, with the data-less
    ServerApp's preflight too, and nothing is logged before the error."""
    from fedrec_flwr.config import make_run_config

    overrides = {
        "dataset": dataset,
        "client": "fedau2",
        "adversary": "dsvae",
        "protected-attribute": "zodiac",
        "results-dir": str(tmp_path / "results"),
    }
    for attempt in (
        lambda: make_run_config(**overrides),
        lambda: preflight({**default_mapping(launch.PROJECT_ROOT / "pyproject.toml"), **overrides}),
    ):
        caplog.clear()
        with caplog.at_level("INFO"), pytest.raises(ConfigError) as caught:
            attempt()
        assert expected in str(caught.value) and str(caught.value).startswith("run-config key"), caught.value
        assert [r.getMessage() for r in caplog.records if r.levelname != "DEBUG"] == []
    assert not (tmp_path / "results").exists()


def test_the_named_datasets_attributes_are_the_ones_their_loaders_read():
    """:data:`fedrec_flwr.attributes.DATASET_ATTRIBUTES` (checked without the data) against the real files."""
    from conftest import dataset_dir

    from fedrec_flwr.attributes import DATASET_ATTRIBUTES
    from fedrec_flwr.data import DATASETS, load_interactions

    assert set(DATASET_ATTRIBUTES) == set(DATASETS) - {"generic"}
    for name, expected in DATASET_ATTRIBUTES.items():
        table = load_interactions(name, dataset_dir(name), download=False).attributes
        assert tuple(sorted(table.columns) if table is not None else ()) == expected, name
