"""How a section declares a run-config key, and the checks several sections share (no Flower, no torch)."""

from __future__ import annotations

from dataclasses import field
from typing import Any

from fedrec_flwr.errors import ConfigError

INT_MAX = 2**31 - 1
"""The largest value of any integer key (and of each entry of ``ks``, ``mlp-layers`` and ``forget-users``) unless
the key has a smaller maximum: every integer the run uses then fits numpy's and torch's int32/int64 and C ``long``
(an unchecked ``forget-users = "10000000000000000000"`` ended in a raw ``OverflowError``)."""


def config_key(
    name: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    positive: bool = False,
    choices: tuple[str, ...] = (),
) -> Any:
    """A dataclass field for the run-config key ``name`` (kebab-case), with its constraints as field metadata.

    Args:
        name: the key as ``pyproject.toml`` spells it; the attribute is its snake_case form.
        minimum, maximum: inclusive bounds of a numeric key (``None``: none; integers are at most :data:`INT_MAX`).
        positive: the value must be > 0.
        choices: the allowed values of a string key (``()``: any string).
    """
    return field(
        metadata={"key": name, "min": minimum, "max": maximum, "positive": positive, "choices": tuple(choices)}
    )


def int_list(key: str, text: str) -> tuple[int, ...]:
    """The positive integers of a comma-separated key such as ``ks = "5,10"``.

    Raises:
        ConfigError: a part is not an integer, is not positive, or exceeds :data:`INT_MAX` (naming the key).
    """
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        raise ConfigError(
            f"run-config key '{key}' = {text!r}: expected comma-separated integers in one string, e.g. "
            f'{key}="5,10" (--run-config) or {key}=5,10 (the launcher); not a TOML array'
        ) from None
    if any(v <= 0 for v in values):
        raise ConfigError(f"run-config key '{key}' = {text!r}: every value must be a positive integer")
    if any(v > INT_MAX for v in values):
        raise ConfigError(f"run-config key '{key}' = {text!r}: every value must be <= {INT_MAX}")
    return values
