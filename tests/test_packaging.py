"""The package as a user installs it: a wheel in a fresh virtual environment, run from a folder of the user's own.

The wheel venv holds only this package; the dependencies come from the test environment (a ``.pth`` line naming its
site-packages: no download), and Flower's console scripts are written from flwr's own entry points, as pip would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from importlib.metadata import distribution
from pathlib import Path

import pytest
from conftest import write_tiny_dataset

ROOT = Path(__file__).resolve().parents[1]
USER_FOLDER_INIT = 'raise ImportError("the user\'s own {name}/ folder was imported")\n'


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of the tracked files (setuptools reuses a ``build/`` folder it finds in the tree)."""
    import shutil

    out = tmp_path_factory.mktemp("wheel")
    source = tmp_path_factory.mktemp("source") / "fedrec-flwr"
    tracked = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        text=True,
    )
    if tracked.returncode == 0:
        for name in tracked.stdout.splitlines():
            if (ROOT / name).is_file():
                (source / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, source / name)
    else:  # no git: everything but the usual build and environment folders
        shutil.copytree(
            ROOT,
            source,
            ignore=shutil.ignore_patterns(".git", ".venv", "build", "dist", "results", "__pycache__", "*.egg-info"),
        )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(out),
            str(source),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    (found,) = out.glob("fedrec_flwr-*.whl")
    return found


@pytest.fixture(scope="module")
def wheel_venv(wheel, tmp_path_factory) -> Path:
    """A venv with only the wheel installed; dependencies from the test environment."""
    venv = tmp_path_factory.mktemp("venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    (purelib / "_test_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # pip reads what is installed from the venv's path: a PYTHONPATH naming a source tree (with its
    # fedrec_flwr.egg-info) would make it skip the wheel as "already satisfied"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FEDREC_FLWR_PYPROJECT")}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--quiet",
            "--no-deps",
            "--force-reinstall",
            str(wheel),
        ],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    for entry in distribution("flwr").entry_points:
        if entry.group == "console_scripts":
            module, _, attr = entry.value.partition(":")
            script = venv / "bin" / entry.name
            script.write_text(
                f"#!{python}\nimport sys\nfrom {module} import {attr.split('.')[0]}\nsys.exit({attr}())\n"
            )
            script.chmod(0o755)
    return venv


def _run(venv: Path, code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FEDREC_FLWR_PYPROJECT")}
    return subprocess.run(
        [str(venv / "bin" / "python"), "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def _user_folder(tmp_path: Path) -> Path:
    """A working folder holding a ``strategies/`` and a ``clients/`` package of the user's own."""
    folder = tmp_path / "work"
    for name in ("strategies", "clients"):
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text(USER_FOLDER_INIT.format(name=name))
    return folder


def test_the_wheel_holds_one_import_name_the_app_and_its_metadata(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
        assert top == {"fedrec_flwr"}
        assert "fedrec_flwr/py.typed" in names
        assert "fedrec_flwr/strategies/item_fedavg.py" in names and "fedrec_flwr/clients/fedrec.py" in names
        assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names)
        app = tomllib.loads(archive.read("fedrec_flwr/_app/pyproject.toml").decode())
        metadata = next(archive.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    source = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert app["tool"]["flwr"]["app"]["config"] == source["tool"]["flwr"]["app"]["config"]
    assert app["tool"]["flwr"]["app"]["components"] == source["tool"]["flwr"]["app"]["components"]
    assert app["tool"]["flwr"]["app"]["fab-include"] == ["/pyproject.toml"]
    assert "License-Expression: Apache-2.0" in metadata
    from packaging.specifiers import SpecifierSet

    (requires,) = [line.split(":", 1)[1] for line in metadata.splitlines() if line.startswith("Requires-Python:")]
    assert SpecifierSet(requires) == SpecifierSet(source["project"]["requires-python"])


def test_every_package_folder_is_declared_for_the_wheel():
    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    mapped = {"clients": "fedrec_flwr.clients", "strategies": "fedrec_flwr.strategies"}
    found = set()
    for init in ROOT.glob("fedrec_flwr/**/__init__.py"):
        found.add(".".join(init.parent.relative_to(ROOT).parts))
    for folder, name in mapped.items():
        if (ROOT / folder / "__init__.py").is_file():
            found.add(name)
            found.update(
                f"{name}." + ".".join(i.parent.relative_to(ROOT / folder).parts)
                for i in (ROOT / folder).glob("*/**/__init__.py")
            )
    assert declared == found


def test_only_fedrec_flwr_is_an_import_name_of_the_wheel(wheel_venv, tmp_path):
    done = _run(
        wheel_venv,
        "import fedrec_flwr, fedrec_flwr.strategies.item_fedavg, fedrec_flwr.clients.fedrec\n"
        "print(fedrec_flwr.__version__, fedrec_flwr.__file__)\n"
        "for name in ('strategies', 'clients'):\n"
        "    try:\n        __import__(name)\n    except ModuleNotFoundError:\n        pass\n"
        "    else:\n        raise SystemExit(name + ' is importable')\n",
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    version, path = done.stdout.split()
    assert version == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert str(wheel_venv) in path
    script = subprocess.run(
        [str(wheel_venv / "bin" / "fedrec"), "--version"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert script.returncode == 0 and script.stdout.split() == ["fedrec", version], script.stderr


@pytest.mark.parametrize("where", ["source", "wheel"])
def test_a_users_own_strategies_and_clients_folders_shadow_nothing(where, wheel_venv, tmp_path):
    folder = _user_folder(tmp_path)
    code = (
        "from fedrec_flwr.registry import resolve\n"
        "print(resolve('strategy', 'item-fedavg').__module__, resolve('client', 'fedau2').__module__)\n"
    )
    if where == "source":
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=folder, env=env, capture_output=True, text=True, timeout=120
        )
    else:
        done = _run(wheel_venv, code, folder)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["fedrec_flwr.strategies.item_fedavg", "fedrec_flwr.clients.fedau2"]


def test_the_wheel_runs_one_round_with_flwr_run_from_a_users_folder(wheel_venv, tmp_path):
    """``python -m fedrec_flwr.launch run`` from the wheel: the defaults and the Flower app come from the installed
    package (no checkout), and the user's ``strategies/`` and ``clients/`` folders in the working folder are not
    imported by the launcher, the ServerApp or the ClientApps."""
    folder = _user_folder(tmp_path)
    data = write_tiny_dataset(tmp_path / "data")
    results = tmp_path / "results"
    overrides = {
        "dataset": "generic",
        "generic-file": str(data),
        "cache-dir": str(tmp_path / "cache"),
        "num-test-negatives": 20,
        "ks": "5,10",
        "embedding-dim": 8,
        "mlp-layers": "16,8",
        "num-server-rounds": 1,
        "users-per-node": 12,
        "results-dir": str(results),
        "run-name": "wheel",
        "round-timeout": 600.0,
    }
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FEDREC_FLWR_PYPROJECT")}
    env.update(FLWR_HOME=str(tmp_path / "flwr-home"), PATH=f"{wheel_venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    done = subprocess.run(
        [
            str(wheel_venv / "bin" / "python"),
            "-m",
            "fedrec_flwr.launch",
            "run",
            "--federation-config",
            "client-resources-num-cpus=1",
            *[f"{k}={v}" for k, v in overrides.items()],
        ],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "_app" in done.stdout  # flwr run was given the installed app
    summary = json.loads((results / "wheel" / "summary.json").read_text())
    assert summary["final"]["round"] == 1 and summary["final"]["eval-users"] == 24
    assert (results / "wheel" / "final_arrays.npz").is_file()
    assert "own strategies/ folder was imported" not in done.stdout + done.stderr


def test_a_missing_app_pyproject_is_one_line_not_a_traceback(tmp_path):
    """A source tree copied without its ``pyproject.toml`` (or a wheel built without ``setup.py``)."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(ROOT / "fedrec_flwr", copy / "fedrec_flwr", ignore=shutil.ignore_patterns("__pycache__", "_app"))
    env = {k: v for k, v in os.environ.items() if k != "FEDREC_FLWR_PYPROJECT"}
    env["PYTHONPATH"] = str(copy)
    done = subprocess.run(
        [sys.executable, "-m", "fedrec_flwr.launch", "run", "num-server-rounds=1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "pyproject.toml" in lines[0] and "Traceback" not in done.stderr


def test_config_json_records_what_produced_the_run(tmp_path, monkeypatch):
    from importlib.metadata import version

    from fedrec_flwr.state.results import SOURCE_COMMIT_ENV, RunRecorder, source_commit

    RunRecorder(tmp_path / "run", {"seed": 0}, {"dataset": {}})
    produced = json.loads((tmp_path / "run" / "config.json").read_text())["produced-by"]
    assert produced["version"] == version("fedrec-flwr")
    assert produced["versions"]["flwr"] == version("flwr") and produced["versions"]["torch"] == version("torch")
    assert set(produced["versions"]) == {"python", "flwr", "torch", "numpy", "pandas"}
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert produced["git-commit"].split("-")[0] == head.stdout.strip()
    # a folder that is no checkout (the unpacked FAB): the launcher's variable, else None
    monkeypatch.delenv(SOURCE_COMMIT_ENV, raising=False)
    assert source_commit(tmp_path) is None
    monkeypatch.setenv(SOURCE_COMMIT_ENV, "abc123")
    assert source_commit(tmp_path) == "abc123"


DEPLOYED = """
import json, sys
from pathlib import Path
from fedrec_flwr.launch.deploy import Deployment, app_snapshot
from fedrec_flwr.launch import PROJECT_ROOT

root, overrides = Path(sys.argv[1]), json.loads(sys.argv[2])
assert PROJECT_ROOT.name == "_app", PROJECT_ROOT  # the installed app, not a checkout
deployment = Deployment(root / "deploy", num_supernodes=2, project=app_snapshot(root / "app", PROJECT_ROOT))
with deployment:
    outcome = deployment.run(overrides, timeout=900)
print(json.dumps({"rows": outcome.metrics(), "left": deployment.leftover()}))
"""


@pytest.mark.slow
def test_the_wheel_runs_a_deployed_round_on_a_superlink_and_two_supernodes(wheel_venv, tmp_path):
    folder = _user_folder(tmp_path)
    data = write_tiny_dataset(tmp_path / "data")
    overrides = {
        "dataset": "generic",
        "generic-file": str(data),
        "cache-dir": str(tmp_path / "cache"),
        "num-test-negatives": 20,
        "ks": "5,10",
        "embedding-dim": 8,
        "mlp-layers": "16,8",
        "num-server-rounds": 1,
        "users-per-node": 12,
        "results-dir": str(tmp_path / "results"),
        "run-name": "deployed",
        "fraction-train": 0.5,
    }
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FEDREC_FLWR_PYPROJECT")}
    env["PATH"] = f"{wheel_venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    done = subprocess.run(
        [str(wheel_venv / "bin" / "python"), "-c", DEPLOYED, str(tmp_path), json.dumps(overrides)],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert [row["round"] for row in result["rows"]] == [1] and result["rows"][0]["num-replies"] >= 1
    assert result["rows"][0]["num-failures"] == 0 and not result["left"]
