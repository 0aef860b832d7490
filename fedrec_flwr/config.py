"""The run configuration: one typed, validated object built once from Flower's ``run_config``.

Every key and its default is declared once, in ``[tool.flwr.app.config]`` of ``pyproject.toml`` (kebab-case, one
comment per key). One section per group of keys gives each key its Python type and its constraints (the data
section beside the data pipeline, :mod:`fedrec_flwr.data.config`; the others in :mod:`fedrec_flwr.sections`);
:class:`RunConfig` inherits them all (the client-unlearning section beside the unlearning algorithms,
:mod:`fedrec_flwr.unlearning.settings`), and turns a mapping (Flower's ``context.run_config``) into one frozen,
flat object (``config.embedding_dim``). Unknown keys, missing keys, ill-typed values and values out of range raise
:class:`~fedrec_flwr.errors.ConfigError` naming the key and the value.

Outside Flower (tests, notebooks, experiment scripts), :func:`default_run_config` reads the defaults from the project's
``pyproject.toml`` and :func:`make_run_config` overrides some of them.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedrec_flwr.data.config import DataSection
from fedrec_flwr.data.datasets import DATASETS
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.sections.adversary import FIRST_RELEASE_ADVERSARY, AdversarySection, resolve_adversary
from fedrec_flwr.sections.deployment import DeploymentSection
from fedrec_flwr.sections.federation import MESSAGE_TTL, FederationSection
from fedrec_flwr.sections.fields import INT_MAX
from fedrec_flwr.sections.training import TrainingSection
from fedrec_flwr.unlearning.settings import UnlearningSection, resolve_post_check, resolve_unlearning

__all__ = [
    "DATASETS",
    "FIRST_RELEASE_ADVERSARY",
    "INT_MAX",
    "MESSAGE_TTL",
    "MODEL_LEARNING_RATES",
    "RunConfig",
    "app_root",
    "default_mapping",
    "default_run_config",
    "find_pyproject",
    "make_run_config",
    "plugin_keys",
    "register_extra_keys",
]

MODEL_LEARNING_RATES: dict[str, float] = {"ncf": 0.01, "pfedrec": 0.01, "mf": 0.03}
"""What ``learning-rate = 0`` (the default) means for each model. ``ncf`` (and ``pfedrec``, unchanged): 0.01, chosen
on the validation item for FedNCF on MovieLens-100K in the first release. ``mf``: 0.03, chosen on the validation item
(HR@10 at round 100, seed 0) across the four shipped datasets, not on one (``experiments/tuning``):

==============  =====  =====  =====  =====
rate            0.01   0.03   0.1    0.3
==============  =====  =====  =====  =====
MovieLens-100K  0.423  0.436  0.443  0.562
FilmTrust       0.906  0.902  0.782  0.733
Lastfm-2K       0.666  0.668  0.459  0.457
Amazon-Video    0.624  0.630  0.554  n/a
==============  =====  =====  =====  =====

0.3, MovieLens-100K's best, loses 0.17-0.21 on FilmTrust and Lastfm-2K and its training loss climbs above ln 2 (to
1.0-1.4 from round 8 on MovieLens-100K); 0.03 is best or within 0.004 of it on the other three and leaves ln 2 at once
on MovieLens-100K (loss 0.683 / 0.657 / 0.647 in rounds 1 / 3 / 5). On the three smaller datasets the loss still
stays near ln 2 for about 8 rounds at 0.03 (an initialisation effect, see README). Set ``learning-rate = 0.3`` on
MovieLens-100K for its validation-best FedMF, ``0.01`` for the first release's."""


@dataclass(frozen=True)
class RunConfig(
    UnlearningSection, DeploymentSection, FederationSection, AdversarySection, TrainingSection, DataSection
):
    """A validated run configuration. Attribute names are the kebab-case keys with ``-`` replaced by ``_``.

    The keys of the data, training, FedAU², federation, deployment and client-unlearning sections are inherited
    (their fields come in that order). See ``[tool.flwr.app.config]`` in
    ``pyproject.toml`` for the meaning and default of each key.
    """

    extra: Mapping[str, Any] = field(default_factory=dict, metadata={"key": None})
    """Keys declared by plug-in clients or strategies (see :func:`register_extra_keys`), validated by them."""

    def check_files(self, data_dir: str | None = None) -> None:
        """Validate the keys that name files and folders on this machine (the second half of validation).

        :meth:`from_mapping` checks what holds anywhere; the files a key names exist only where the data is read
        (the SuperNodes, a simulation or a serial run: the ServerApp never reads the data), so every process that loads
        the split calls this first (:func:`fedrec_flwr.app.runtime.load_split_for`). ``data_dir`` overrides ``data-dir`` for the
        named datasets (``$FEDREC_DATA_DIR`` when the key is empty).

        Raises:
            ConfigError: ``data-dir`` does not exist (or is a file for a named dataset), ``cache-dir`` is a file, a
                generic dataset's file is missing (:meth:`generic_files`), or ``device`` names a CUDA device this
                machine lacks. The message names the key and value.
        """
        self._check_data_files(data_dir)
        self._check_device_here()

    @property
    def effective_unlearn_round(self) -> int:
        """``unlearn-round``, with 0 meaning the last round."""
        return self.unlearn_round or self.num_server_rounds

    def to_dict(self) -> dict[str, Any]:
        """The configuration as a kebab-case mapping, the form Flower's ``run_config`` has."""
        out = {f.metadata["key"]: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata["key"]}
        out.update(self.extra)
        return out

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with some keys changed (kebab-case or snake_case names), validated again."""
        values = self.to_dict()
        for name, value in changes.items():
            values[name.replace("_", "-")] = value
        return RunConfig.from_mapping(values)

    # ------------------------------------------------------------------------------------------------ construction
    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> RunConfig:
        """Validate ``mapping`` (kebab-case keys, e.g. Flower's ``context.run_config``) into a :class:`RunConfig`.

        Raises:
            ConfigError: a key is unknown or missing, a value has the wrong type, is not one of the allowed
                choices, or is out of range. The message names the key and the value.
        """
        fields = {f.metadata["key"]: f for f in dataclasses.fields(cls) if f.metadata["key"]}
        declared = plugin_keys(mapping)
        unknown = sorted(set(mapping) - set(fields) - set(_EXTRA_KEYS) - set(declared))
        if unknown:
            raise ConfigError(_unknown_keys_message(unknown, set(fields) | set(_EXTRA_KEYS) | set(declared)))
        missing = sorted(set(fields) - set(mapping))
        if missing:
            raise ConfigError(f"run-config key(s) {missing} missing (declare them in [tool.flwr.app.config])")
        values: dict[str, Any] = {}
        for key, f in fields.items():
            values[f.name] = _coerce(key, mapping[key], f.type, f.metadata)
        if values["learning_rate"] == 0.0 and values["model"] in MODEL_LEARNING_RATES:  # 0 = the model's default
            values["learning_rate"] = MODEL_LEARNING_RATES[values["model"]]
        values["adversary"] = resolve_adversary(values["adversary"], values["client"], values["protected_attribute"])
        values["unlearning"] = resolve_unlearning(
            values["unlearning"], values["forget_users"], values["forget_fraction"], values["unlearning_history"]
        )
        values["unlearning_post_check"] = resolve_post_check(
            values["unlearning_post_check"], values["unlearning"], values["holdout_validation"]
        )
        extra = {key: mapping[key] for key in _EXTRA_KEYS if key in mapping}
        extra.update(_plugin_values(declared, mapping, values.get("plugin_config", "")))
        config = cls(**values, extra=extra)
        config._check_relations()
        return config

    def _check_relations(self) -> None:
        for f in dataclasses.fields(self):
            allowed = f.metadata.get("choices")
            if allowed and getattr(self, f.name) not in allowed:
                key, value = f.metadata["key"], getattr(self, f.name)
                raise ConfigError(f"run-config key '{key}' = {value!r}: must be one of {list(allowed)}")
        self._check_data()
        self._check_training()
        self._check_federation()
        self._check_adversary()
        self._check_unlearning()
        if not self.client or not self.strategy:
            raise ConfigError("run-config keys 'client' and 'strategy' must name a registered entry or module:Class")


# Keys that plug-ins (later client algorithms and strategies) add; each is validated by its owner.
_EXTRA_KEYS: dict[str, str] = {}


def plugin_keys(mapping: Mapping[str, Any]) -> dict[str, tuple[Any, str, str]]:
    """The own run-config keys of the plug-in strategy and client that ``mapping`` names as ``"module:Class"``:
    ``{key: (default, meaning, "strategy 'module:Class'")}``, from each class's ``config_keys`` attribute
    (``{"server-lr": (0.5, "server learning rate")}``; the default's type is the key's type). Registered names
    (built-in components) declare none.

    Raises:
        ConfigError: a plug-in cannot be imported, or two plug-ins declare the same key, or one shadows a built-in key.
    """
    from fedrec_flwr.registry import resolve

    declared: dict[str, tuple[Any, str, str]] = {}
    for kind in ("strategy", "client"):
        spec = mapping.get(kind)
        if not isinstance(spec, str) or ":" not in spec:
            continue
        for key, entry in dict(getattr(resolve(kind, spec), "config_keys", None) or {}).items():
            default, meaning = entry if isinstance(entry, tuple) else (entry, "")
            owner = f"{kind} {spec!r}"
            clash = declared.get(key, (None, "", None))[2] or (
                "a built-in key" if key in _builtin_keys() or key in _EXTRA_KEYS else None
            )
            if clash:
                raise ConfigError(f"run-config key '{key}' declared by {owner} is already {clash}: rename it")
            declared[key] = (default, meaning, owner)
    return declared


def _builtin_keys() -> set[str]:
    return {f.metadata["key"] for f in dataclasses.fields(RunConfig) if f.metadata["key"]}


def _plugin_values(
    declared: Mapping[str, tuple[Any, str, str]], mapping: Mapping[str, Any], packed: str
) -> dict[str, Any]:
    """Every declared plug-in key's value: given directly in ``mapping``, else in ``plugin-config`` (``packed``,
    ``"key=value ..."`` as Flower's ``--run-config`` writes it), else its default; checked against the default's type.

    Raises:
        ConfigError: ``plugin-config`` is malformed or names an undeclared key, or a value has the wrong type.
    """
    from flwr.common.config import parse_config_args

    try:
        given = parse_config_args([packed]) if packed else {}
    except Exception as err:  # click.ClickException: not "key=value ..." with TOML values
        raise ConfigError(
            f"run-config key 'plugin-config' = {packed!r}: expected \"key=value ...\" with TOML values ({err})"
        ) from None
    stray = sorted(set(given) - set(declared))
    if stray:
        raise ConfigError(
            f"run-config key 'plugin-config' names {stray}, which no configured plug-in declares "
            f"(declared: {sorted(declared) or 'none'})"
        )
    twice = sorted(k for k in set(given) & set(mapping) if given[k] != mapping[k])
    if twice:
        raise ConfigError(
            f"run-config key '{twice[0]}' is given twice: {twice[0]}={mapping[twice[0]]!r} and in "
            f"plugin-config ({twice[0]}={given[twice[0]]!r}); give it once"
        )
    values = {}
    for key, (default, _, _owner) in declared.items():
        value = mapping.get(key, given.get(key, default))
        kind = type(default).__name__
        if kind in ("bool", "int", "float", "str"):
            value = _coerce(key, value, kind, {})
        values[key] = value
    return values


def _unknown_keys_message(unknown: list[str], valid: set[str]) -> str:
    """An unknown-key error with the nearest valid keys and where keys come from (not a list of all of them)."""
    import difflib

    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, sorted(valid), n=3, cutoff=0.6)
        if key == "num-supernodes":
            hints.append(
                "'num-supernodes' is a federation setting, not a run-config key: python -m fedrec_flwr.launch "
                'run --num-supernodes N (flwr run: --federation-config "num-supernodes=N")'
            )
        elif key.startswith(("client-resources-", "init-args-")):
            hints.append(f"'{key}' is a federation setting, not a run-config key: --federation-config {key}=...")
        elif close:
            hints.append(f"'{key}': did you mean {' or '.join(repr(c) for c in close)}")
    return (
        f"unknown run-config key(s) {unknown}"
        + ("; " + "; ".join(hints) if hints else "")
        + f" (all {len(valid)} keys, with their meaning: pyproject.toml [tool.flwr.app.config]; a plug-in strategy "
        "or client declares its own keys in its class attribute config_keys)"
    )


def register_extra_keys(owner: str, keys: Mapping[str, str]) -> None:
    """Let a plug-in (client algorithm or strategy) declare its own run-config keys.

    Args:
        owner: who owns the keys (for error messages).
        keys: kebab-case key -> one-line meaning. The plug-in validates the values itself.
    """
    for key, meaning in keys.items():
        _EXTRA_KEYS[key] = f"{owner}: {meaning}"


def _coerce(key: str, value: Any, annotation: Any, meta: Mapping[str, Any]) -> Any:
    type_name = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    if type_name == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"run-config key '{key}' = {value!r}: expected true or false")
        return value
    if type_name == "int":
        if isinstance(value, bool):
            raise ConfigError(f"run-config key '{key}' = {str(value).lower()}: expected an integer, got a boolean")
        if isinstance(value, float):  # TOML's 10.0 or 1e9 is a float: never silently taken as an integer
            hint = f"; write {int(value)}" if value.is_integer() else ""
            raise ConfigError(f"run-config key '{key}' = {value!r}: expected an integer, got the float {value!r}{hint}")
        if not isinstance(value, int):
            raise ConfigError(f"run-config key '{key}' = {value!r}: expected an integer")
    elif type_name == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"run-config key '{key}' = {value!r}: expected a number")
        value = float(value)
        if value != value or value in (float("inf"), float("-inf")):
            raise ConfigError(f"run-config key '{key}' = {value!r}: expected a finite number")
    elif type_name == "str":
        if not isinstance(value, str):
            hint = ""
            if isinstance(value, (list, tuple)):  # e.g. forget-users = [3, 17]: Flower's run config holds no lists
                hint = f'; write the list as one string, {key} = "{",".join(str(v) for v in value)}"'
            raise ConfigError(f"run-config key '{key}' = {value!r}: expected a string{hint}")
        return value
    if type_name == "int" and meta.get("max") is None and value > INT_MAX:
        raise ConfigError(f"run-config key '{key}' = {value!r}: must be <= {INT_MAX}")
    if meta.get("min") is not None and value < meta["min"]:
        raise ConfigError(f"run-config key '{key}' = {value!r}: must be >= {meta['min']}")
    if meta.get("max") is not None and value > meta["max"]:
        raise ConfigError(f"run-config key '{key}' = {value!r}: must be <= {meta['max']}")
    if meta.get("positive") and not value > 0:
        raise ConfigError(f"run-config key '{key}' = {value!r}: must be > 0")
    return value


PACKAGED_APP = Path(__file__).resolve().parent / "_app"
"""In an installed wheel: the folder holding the app's ``pyproject.toml``, copied there at build time (``setup.py``),
so the defaults and the Flower app travel with the package instead of being read from a source checkout."""


def _is_app_pyproject(path: Path) -> bool:
    """Whether ``path`` is this package's ``pyproject.toml`` (``[project] name = "fedrec-flwr"`` and a
    ``[tool.flwr.app.config]`` table), not some other project's file that happens to sit beside the package."""
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except (OSError, tomllib.TOMLDecodeError):
        return False
    return data.get("project", {}).get("name") == "fedrec-flwr" and isinstance(
        data.get("tool", {}).get("flwr", {}).get("app", {}).get("config"), dict
    )


def app_root() -> Path:
    """The folder of the Flower app that ``flwr run`` is given: the source checkout (the ``pyproject.toml`` beside
    the package) when the package runs from one, else the installed copy in :data:`PACKAGED_APP`.

    The installed copy holds only ``pyproject.toml``: its FAB carries no code, so the ServerApp and ClientApps
    import ``fedrec_flwr`` from the environment they run in, which must have the package installed.

    Raises:
        ConfigError: neither holds this package's ``pyproject.toml`` (a wheel built without ``setup.py``).
    """
    checkout = Path(__file__).resolve().parents[1]
    for folder in (checkout, PACKAGED_APP):
        if _is_app_pyproject(folder / "pyproject.toml"):
            return folder
    raise ConfigError(
        f"cannot find fedrec-flwr's pyproject.toml (the run-config defaults and the Flower app) in {checkout} "
        f"or {PACKAGED_APP}; reinstall the package (pip install fedrec-flwr) or set FEDREC_FLWR_PYPROJECT"
    )


def find_pyproject() -> Path:
    """Locate the app's ``pyproject.toml``: ``$FEDREC_FLWR_PYPROJECT``, else the one in :func:`app_root`.

    Raises:
        ConfigError: ``$FEDREC_FLWR_PYPROJECT`` names no file, or :func:`app_root` finds none.
    """
    env = os.environ.get("FEDREC_FLWR_PYPROJECT")
    if env:
        if not Path(env).is_file():
            raise ConfigError(f"FEDREC_FLWR_PYPROJECT={env!r}: no such file")
        return Path(env)
    return app_root() / "pyproject.toml"


def default_mapping(pyproject: str | os.PathLike | None = None) -> dict[str, Any]:
    """The defaults of ``[tool.flwr.app.config]`` as a kebab-case mapping.

    Raises:
        ConfigError: the file cannot be read, is not TOML, or has no such table.
    """
    path = Path(pyproject) if pyproject else find_pyproject()
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the run-config defaults ({err.strerror or err})") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML ({err})") from None
    try:
        return dict(data["tool"]["flwr"]["app"]["config"])
    except KeyError:
        raise ConfigError(f"{path}: no [tool.flwr.app.config] table") from None


def default_run_config(pyproject: str | os.PathLike | None = None) -> RunConfig:
    """The validated defaults from ``pyproject.toml``."""
    return RunConfig.from_mapping(default_mapping(pyproject))


def make_run_config(**overrides: Any) -> RunConfig:
    """The defaults with some keys overridden; keyword names may use ``_`` for ``-``.

    Example:
        ``make_run_config(dataset="filmtrust", num_server_rounds=5)``
    """
    mapping = default_mapping()
    for name, value in overrides.items():
        mapping[name.replace("_", "-")] = value
    return RunConfig.from_mapping(mapping)
