"""Run-config overrides and federation settings from the command line's words, and the ``--run-config`` and
``--federation-config`` arguments ``flwr run`` gets from them, which Flower parses back exactly."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fedrec_flwr.config import default_mapping
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.launch.env import PROJECT_ROOT

FEDERATION_KEYS = {
    "num-supernodes": "--num-supernodes N",
    "client-resources-num-cpus": "--federation-config client-resources-num-cpus=N",
    "client-resources-num-gpus": "--federation-config client-resources-num-gpus=N",
    "init-args-num-cpus": "--federation-config init-args-num-cpus=N",
    "init-args-num-gpus": "--federation-config init-args-num-gpus=N",
}
"""Federation (simulation) settings users give as run-config keys by mistake -> the flag that sets them."""


def _toml_string(text: str) -> str:
    """``text`` as a TOML basic string that Flower's ``--run-config`` parser (a regex that ends a double-quoted value
    at the next ``"``) hands to TOML unchanged: ``"`` and control characters become ``\\uXXXX``, ``\\`` becomes
    ``\\\\``; everything else (apostrophes, spaces, non-ASCII) stays literal."""
    out = []
    for char in text:
        if char == "\\":
            out.append("\\\\")
        elif char == '"' or ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04X}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    raise ConfigError(f"run-config value {value!r}: only strings, numbers and booleans can be passed to flwr run")


def run_config_args(overrides: Mapping[str, Any], declared: Iterable[str] | None = None) -> list[str]:
    """``--run-config`` arguments for ``flwr run`` from a mapping of overrides; Flower parses each value back exactly
    (``flwr.common.config.parse_config_args``).

    Keys that ``[tool.flwr.app.config]`` does not declare (``declared``, default: this project's keys) are a plug-in's
    own keys, which Flower would refuse: they travel packed into ``plugin-config`` (``"key=value ..."``), which
    :meth:`fedrec_flwr.config.RunConfig.from_mapping` unpacks and checks against the plug-in's ``config_keys``."""
    if not overrides:
        return []
    for key in overrides:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", str(key)):
            raise ConfigError(f"run-config key {key!r}: keys are letters, digits, '-', '_' and '.'")
    known = set(default_mapping(PROJECT_ROOT / "pyproject.toml") if declared is None else declared)
    plain = {k: v for k, v in overrides.items() if k in known}
    packed = {k: v for k, v in overrides.items() if k not in known}
    if packed:
        if "plugin-config" not in known:
            raise ConfigError(f"run-config key(s) {sorted(packed)} are not in [tool.flwr.app.config]")
        given = str(plain.get("plugin-config") or "")
        if given:
            from flwr.common.config import parse_config_args

            try:
                inside = parse_config_args([given])
            except Exception:  # malformed: RunConfig.from_mapping names the problem in the preflight
                inside = {}
            packed = {k: v for k, v in packed.items() if k not in inside or inside[k] != v}
            twice = sorted(set(packed) & set(inside))
            if twice:
                raise ConfigError(
                    f"run-config key '{twice[0]}' is given twice: {twice[0]}={packed[twice[0]]!r} and "
                    f"in plugin-config ({twice[0]}={inside[twice[0]]!r}); give it once"
                )
        plain["plugin-config"] = " ".join(
            [*([given] if given else []), *(f"{k}={toml_value(v)}" for k, v in packed.items())]
        )
    return ["--run-config", " ".join(f"{k}={toml_value(v)}" for k, v in plain.items())]


def parse_override(pair: str, defaults: Mapping[str, Any] | None = None, what: str = "run-config") -> tuple[str, Any]:
    """``"key=value"`` -> ``(key, value)``.

    Spaces around the ``=`` (and around the whole pair) are dropped, ``"model = ncf"`` being ``model=ncf``: Flower's
    own ``--run-config`` parser (``flwr.common.config.parse_config_args``) would silently skip such a pair. A value
    starting with a quote is a TOML string and must be one; the spaces inside its quotes are kept (``run-name=" a "``).
    Otherwise a key whose default (in ``defaults``) is a string takes the text as it is (``dataset=filmtrust``,
    ``run-name=2024``, ``data-dir=/a/o'b``); other values are TOML (``20``, ``0.5``, ``true``), and text that is not
    TOML stays a string, which the run config's validation then refuses by key if the key needs a number.

    Raises:
        ConfigError: no ``=``, an empty key, a federation setting given as a run-config key (with the flag to use),
            or a quoted value that is not a TOML string (with the fix).
    """
    import tomllib

    key, sep, text = pair.partition("=")
    key, text = key.strip(), text.strip()
    if not sep or not key:
        raise ConfigError(f"{what} override {pair!r} is not key=value")
    if what == "run-config" and key in FEDERATION_KEYS:
        raise ConfigError(
            f"'{key}' is a federation setting, not a run-config key: use "
            f"{FEDERATION_KEYS[key].replace('N', text or 'N', 1) if text else FEDERATION_KEYS[key]}"
        )
    defaults = defaults or {}
    if text[:1] in ("'", '"'):
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError as err:
            balanced = len(text) >= 2 and text[-1] == text[0]
            control = next((c for c in text[1:-1] if not c.isprintable()), None) if balanced else None
            bare = text.strip(chr(39) + chr(34))
            if control is not None:  # the quotes balance: the value holds what a TOML string holds only escaped
                raise ConfigError(
                    f"{what} key '{key}': {text!r} is not a TOML string: it holds the raw control character "
                    f"{control!r}, which TOML takes only escaped ({repr(control)[1:-1]}); write it as "
                    f"{key}={_toml_string(bare)}"
                ) from None
            hint = "an unbalanced quote?" if not balanced else f"TOML: {err}"
            raise ConfigError(
                f"{what} key '{key}': {text!r} is not a quoted string ({hint}); write it without quotes "
                f"({key}={bare}) or as TOML ({key}={_toml_string(bare)})"
            ) from None
        return key, value
    if isinstance(defaults.get(key), str):
        return key, text
    try:
        return key, tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return key, text


def parse_run_options(
    pairs: Sequence[str], federation_pairs: Sequence[str] = (), timeout: str | float | None = None
) -> tuple[float | None, dict[str, Any], dict[str, Any]]:
    """``run``'s values from their words: ``(timeout in seconds or None, run-config overrides, federation config)``.

    Args:
        pairs: the ``key=value`` run-config overrides (:func:`parse_override`, each key once).
        federation_pairs: the ``--federation-config`` values (checked by :func:`check_federation_config`).
        timeout: ``--timeout``'s text.

    Raises:
        ConfigError: a timeout that is not a positive number, a malformed override, a key given twice, or a
            federation setting Flower refuses.
    """
    if timeout is not None:
        try:
            seconds = float(timeout)
        except ValueError:
            seconds = math.nan
        if not seconds > 0:
            raise ConfigError(f"--timeout {timeout}: must be a positive number of seconds")
        timeout = seconds
    defaults = default_mapping(PROJECT_ROOT / "pyproject.toml")
    overrides = _once([parse_override(pair, defaults) for pair in pairs], "run-config key")
    federation = _once(
        [parse_override(pair, {}, "--federation-config") for pair in federation_pairs], "--federation-config key"
    )
    check_federation_config(federation)
    return timeout, overrides, federation


def _once(pairs: Sequence[tuple[str, Any]], what: str) -> dict[str, Any]:
    """``pairs`` as a mapping; a key given twice is refused (silently keeping the last would hide a typo).

    Raises:
        ConfigError: naming the key and both values.
    """
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise ConfigError(f"{what} {key!r} is given twice ({key}={found[key]!r} and {key}={value!r}): give it once")
        found[key] = value
    return found


def check_federation_config(federation: Mapping[str, Any]) -> None:
    """Check ``--federation-config`` keys and values as ``flwr run`` will (its own
    ``flwr.supercore.utils.simulation_config_from_json``: the fields of Flower's ``SimulationConfig``, each of its
    type), before anything starts; ``num-supernodes`` has its own flag.

    Raises:
        ConfigError: an unknown key (with the known ones) or a value of the wrong type or range, naming both.
    """
    from flwr.proto.federation_config_pb2 import SimulationConfig
    from flwr.supercore.utils import simulation_config_from_json

    known = sorted(f.name.replace("_", "-") for f in SimulationConfig.DESCRIPTOR.fields if f.name != "num_supernodes")
    for key, value in federation.items():
        if key == "num-supernodes":
            raise ConfigError(f"--federation-config num-supernodes={value}: use --num-supernodes {value}")
        if key not in known:
            raise ConfigError(
                f"--federation-config {key}={value}: Flower knows no simulation setting {key!r} "
                f"(known: {', '.join(known)})"
            )
        try:
            simulation_config_from_json({key.replace("-", "_"): value})
        except (TypeError, ValueError) as err:
            raise ConfigError(f"--federation-config {key}={value}: Flower refuses the value ({err})") from None
