"""The base client's configuration checks (:class:`fedrec_flwr.clients.fedrec.FedRecClient`'s ``check_config`` and
``check_strategy_config``): run-config keys only an attribute-unlearning client serves, and the values of the keys a
wrapped Flower strategy sends.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from fedrec_flwr.errors import ConfigError

log = logging.getLogger("fedrec_flwr.clients.fedrec")
"""The base client's logger: its checks log under the name of the client's module."""


def check_proximal_mu(config: Mapping[str, Any], strategy: str = "") -> None:
    """Check FedProx's ``"proximal-mu"`` in a wrapped Flower strategy's train ``config``, where it is set.

    Args:
        config: train-config key -> value, as the strategy would send it.
        strategy: the run-config ``strategy`` (named in the error).

    Raises:
        ConfigError: ``"proximal-mu"`` is not a finite number >= 0 (names the strategy and ``strategy-args``).
    """
    if "proximal-mu" in config:
        mu = config["proximal-mu"]
        if isinstance(mu, bool) or not isinstance(mu, (int, float)) or not math.isfinite(mu) or mu < 0:
            raise ConfigError(
                f"run-config key 'strategy' = {strategy!r} sends 'proximal-mu' = {mu!r}: FedProx's "
                "proximal weight must be a finite number >= 0 (run-config key 'strategy-args')"
            )


def refuse_attribute_keys(config) -> None:
    """Refuse the attribute-unlearning keys a client without an attribute adversary would silently ignore
    (``adversary`` other than ``"none"``, ``user-embedding-noise`` other than 0), and log a warning for an unused
    ``protected-attribute``.

    Args:
        config: the run's :class:`~fedrec_flwr.config.RunConfig`.

    Raises:
        ConfigError: naming the keys this run sets, their values and the client.
    """
    given = [
        f"'{key}' = {value!r}"
        for key, value, unset in (
            ("adversary", config.adversary, config.adversary == "none"),
            ("user-embedding-noise", config.user_embedding_noise, config.user_embedding_noise == 0),
        )
        if not unset
    ]  # only the keys this run sets: the other one's default would mislead
    if given:
        keys, them = ("keys", "them") if len(given) > 1 else ("key", "it")
        raise ConfigError(
            f"run-config {keys} {' and '.join(given)} need{'s' if len(given) == 1 else ''} an "
            f"attribute-unlearning client (client = 'fedau2' or 'fedau2-gel'); client {config.client!r} "
            f"would ignore {them}"
        )
    if config.protected_attribute:
        log.warning(
            "run-config key 'protected-attribute' = %r is unused: client %r trains no adversary "
            "(the attribute is read by client = 'fedau2' or 'fedau2-gel')",
            config.protected_attribute,
            config.client,
        )
