"""The federation section of the run configuration: the server strategy, the rounds, which users train and evaluate
in each, how the server aggregates and steps, and how users map onto SuperNodes and messages.

:class:`FederationSection` declares the keys of the ``federation`` group of ``[tool.flwr.app.config]`` (their defaults
and meanings are there); :class:`fedrec_flwr.config.RunConfig` inherits it.
"""

from __future__ import annotations

from dataclasses import dataclass

from flwr.app import DEFAULT_TTL

from fedrec_flwr.errors import ConfigError
from fedrec_flwr.sections.fields import config_key

MESSAGE_TTL = float(DEFAULT_TTL)
"""The lifetime of every message our apps send, seconds: Flower's ``flwr.app.DEFAULT_TTL`` (43200 = 12 hours in flwr
1.42, ``flwr/app/constants.py``), which ``Message(..., ttl=None)`` uses. A ``round-timeout`` longer than this would wait
for replies to messages that have already expired, so it is refused."""


@dataclass(frozen=True)
class FederationSection:
    """The run-config keys of the federation: strategy, rounds, sampling, aggregation, message flow and seed."""

    strategy: str = config_key("strategy")
    strategy_args: str = config_key("strategy-args")
    plugin_config: str = config_key("plugin-config")
    num_server_rounds: int = config_key("num-server-rounds", minimum=1)
    fraction_train: float = config_key("fraction-train", positive=True, maximum=1.0)
    fraction_evaluate: float = config_key("fraction-evaluate", minimum=0.0, maximum=1.0)
    item_aggregation: str = config_key("item-aggregation", choices=("auto", "touched", "selected"))
    server_optimizer: str = config_key("server-optimizer", choices=("adam", "sgd"))
    server_learning_rate: float = config_key("server-learning-rate", positive=True)
    evaluate_validation: bool = config_key("evaluate-validation")
    min_train_fraction: float = config_key("min-train-fraction", minimum=0.0, maximum=1.0)
    eval_every: int = config_key("eval-every", minimum=1)
    round_timeout: float = config_key("round-timeout", positive=True, maximum=MESSAGE_TTL)
    max_in_flight: int = config_key("max-in-flight", minimum=0)
    fast_link_state: bool = config_key("fast-link-state")
    users_per_node: int = config_key("users-per-node", minimum=1)
    block_training: str = config_key("block-training", choices=("auto", "on", "off"))
    seed: int = config_key("seed", minimum=0)

    def _check_federation(self) -> None:
        """``evaluate-validation`` needs the validation item; called by
        :meth:`fedrec_flwr.config.RunConfig.from_mapping`.

        Raises:
            ConfigError: naming the keys.
        """
        if self.evaluate_validation and not self.holdout_validation:
            raise ConfigError("run-config key 'evaluate-validation' = true needs 'holdout-validation' = true")
