"""The FedAU² section of the run configuration: the protected attribute, the adversary ``h_w`` that learns it, and
how the user embeddings unlearn it (gradient reversal or entropy, DSVAE's noise).

:class:`AdversarySection` declares the keys of the ``attribute unlearning`` group of ``[tool.flwr.app.config]`` (their
defaults and meanings are there); :class:`fedrec_flwr.config.RunConfig` inherits it. :data:`FIRST_RELEASE_ADVERSARY`
holds the values FedAU²'s paper states, which the experiments start from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedrec_flwr.errors import ConfigError
from fedrec_flwr.sections.fields import config_key

FIRST_RELEASE_ADVERSARY: dict[str, Any] = {
    "adversary-trigger": "sut",
    "adversary-objective": "reverse",
    "adversary-epsilon": 1.0,
    "adversary-hidden": 32,
    "adversary-server-learning-rate": 0.01,
    "adversary-server-steps": 1,
    "adversary-class-prior": "",
    "dsvae-noise-placement": "head",
    "dsvae-noise-stream": "per-upload",
    "adversary-weight-rule": "fixed",
    "secure-aggregation": "off",
}
"""FedAU²'s adversary keys as its paper states the mechanism (and as the first release's package defaults had them):
FedAU²'s own selective unlearning trigger and gradient reversal, a 32-wide ``h_w``, one server step of 0.01 per round,
no class prior, DSVAE's noise on the head gradient only and drawn afresh for every upload, a fixed ``eps`` and each
node's ``h_w`` gradient sent in the clear. The package defaults are
the protective arm of ``experiments/fedau2`` (``pyproject.toml``; :mod:`fedrec_flwr.clients.fedau2`). Run-config overrides
(``make_run_config(**FIRST_RELEASE_ADVERSARY, ...)``, or as launcher ``key=value`` pairs): every arm of the FedAU²
experiment tables starts from them (``experiments.fedau2.methods.PROTOCOL``) and the mechanism tests pin them, so
their numbers stay those measured with these values."""


FEDAU2_CLIENTS = ("fedau2", "fedau2-gel")
"""The registered clients that train against an adversary; ``adversary = "auto"`` gives them :data:`AUTO_ADVERSARY`."""
AUTO_ADVERSARY = "mlp"
"""What ``adversary = "auto"`` (the default) means for a FedAU² client with a ``protected-attribute``: the plain
``h_w`` (with the other defaults a linear one, trained by the server under SecAgg+, with the adaptive weight). DSVAE's
noise is not needed once only sums reach the server, and it cost ``h_w`` its competence: the first release's DSVAE
defaults left FedNCF's gender AUC at 0.645 against 0.654 undefended (``experiments/fedau2/results/main-gender.md``)."""


def resolve_adversary(adversary: str, client: str, protected_attribute: str) -> str:
    """``adversary`` with ``"auto"`` resolved: :data:`AUTO_ADVERSARY` for a client of :data:`FEDAU2_CLIENTS` with a
    ``protected-attribute``, else ``"none"``; any other value is returned unchanged."""
    if adversary != "auto":
        return adversary
    return AUTO_ADVERSARY if client in FEDAU2_CLIENTS and protected_attribute else "none"


@dataclass(frozen=True)
class AdversarySection:
    """The run-config keys of attribute unlearning (FedAU², ``client = "fedau2"``)."""

    protected_attribute: str = config_key("protected-attribute")
    adversary: str = config_key("adversary", choices=("auto", "none", "mlp", "dsvae"))
    adversary_trigger: str = config_key("adversary-trigger", choices=("sut", "always"))
    adversary_objective: str = config_key("adversary-objective", choices=("reverse", "entropy"))
    adversary_epsilon: float = config_key("adversary-epsilon", minimum=0.0)
    adversary_training: str = config_key("adversary-training", choices=("server", "per-client"))
    adversary_server_optimizer: str = config_key("adversary-server-optimizer", choices=("adam", "sgd"))
    adversary_server_learning_rate: float = config_key("adversary-server-learning-rate", positive=True)
    adversary_server_steps: int = config_key("adversary-server-steps", minimum=1, maximum=1000)
    # who answers h_w's extra-step queries
    adversary_query_users: str = config_key("adversary-query-users", choices=("sampled", "all"))
    adversary_embedding_optimizer: str = config_key("adversary-embedding-optimizer", choices=("local", "sgd"))
    adversary_class_prior: str = config_key("adversary-class-prior")
    adversary_hidden: int = config_key("adversary-hidden", minimum=0)  # 0: a linear h_w (no hidden layer)
    adversary_warmup_rounds: int = config_key("adversary-warmup-rounds", minimum=0)  # rounds 1..k: h_w learns, eps = 0
    dsvae_latent_dim: int = config_key("dsvae-latent-dim", minimum=1)
    dsvae_kl_weight: float = config_key("dsvae-kl-weight", minimum=0.0)
    dsvae_gradient_noise: float = config_key("dsvae-gradient-noise", minimum=0.0)
    # server uploads: noise on the head only, or all of h_w
    dsvae_noise_placement: str = config_key("dsvae-noise-placement", choices=("head", "all"))
    # server uploads: one noise draw per user, per round, or per upload
    dsvae_noise_stream: str = config_key("dsvae-noise-stream", choices=("per-user", "per-round", "per-upload"))
    user_embedding_noise: float = config_key("user-embedding-noise", minimum=0.0)
    # adversary-training = server: how h_w's per-node vectors reach the server (fedrec_flwr.adversary.secure)
    secure_aggregation: str = config_key("secure-aggregation", choices=("off", "secagg+"))
    # SecAgg+'s Shamir threshold, as a fraction of each node's neighbourhood
    secure_aggregation_threshold: float = config_key("secure-aggregation-threshold", positive=True, maximum=1.0)
    # SecAgg+'s neighbourhood size (odd, >= 3), or 0: every sampled node (plain SecAgg)
    secure_aggregation_num_shares: int = config_key("secure-aggregation-num-shares", minimum=0)
    secure_aggregation_clipping_range: float = config_key("secure-aggregation-clipping-range", positive=True)
    secure_aggregation_quantization_range: int = config_key("secure-aggregation-quantization-range", minimum=2)
    # the GRL weight eps: fixed (adversary-epsilon) or adaptive (fedrec_flwr.adversary.adaptive)
    adversary_weight_rule: str = config_key("adversary-weight-rule", choices=("fixed", "adaptive"))
    adaptive_target_delta: float = config_key("adaptive-target-delta", minimum=0.0, maximum=1.0)
    adaptive_rate: float = config_key("adaptive-rate", positive=True)
    adaptive_epsilon_min: float = config_key("adaptive-epsilon-min", positive=True)
    adaptive_epsilon_max: float = config_key("adaptive-epsilon-max", positive=True)
    adaptive_signal: str = config_key("adaptive-signal", choices=("balanced-accuracy", "balanced-probability"))
    adaptive_smoothing: float = config_key("adaptive-smoothing", minimum=0.0, maximum=0.999)

    def _check_adversary(self) -> None:
        """An adversary needs a ``protected-attribute`` the dataset has; called by
        :meth:`fedrec_flwr.config.RunConfig.from_mapping`.

        Raises:
            ConfigError: naming the key and value (and the dataset's attributes).
        """
        if self.adversary != "none" and not self.protected_attribute:
            raise ConfigError(
                f"run-config key 'adversary' = {self.adversary!r} needs 'protected-attribute' "
                '(the user attribute to unlearn, e.g. "gender")'
            )
        if self.protected_attribute and (self.dataset != "generic" or not self.generic_attributes_file):
            # a named dataset's attributes are known without its files, and 'generic' without an attributes file
            # has none: refused here, before the clients' checks (FedAU²'s warned first that the "published" prior
            # falls back to none for such an attribute); a generic attributes file is checked when it is read
            from fedrec_flwr.attributes import DATASET_ATTRIBUTES, check_attribute_name

            check_attribute_name(self.protected_attribute, DATASET_ATTRIBUTES.get(self.dataset, ()), self.dataset)
        self._check_secure_and_adaptive()

    def _check_secure_and_adaptive(self) -> None:
        """``secure-aggregation`` and ``adversary-weight-rule = "adaptive"`` need the server-trained ``h_w`` (without an
        adversary both are inert); SecAgg+'s
        neighbourhood is odd; the adaptive bounds are ordered and hold ``adversary-epsilon``; the adaptive rule's eps
        travels in this package's train messages, which a Flower strategy (``flwr.serverapp.strategy:...``) replaces.

        Raises:
            ConfigError: naming the keys and values.
        """
        if self.adversary == "none":  # nothing to protect or adapt: both keys are inert (their defaults are on)
            return
        server = self.adversary_training == "server"
        for key, value, off in (
            ("secure-aggregation", self.secure_aggregation, "off"),
            ("adversary-weight-rule", self.adversary_weight_rule, "fixed"),
        ):
            if value != off and not server:
                raise ConfigError(
                    f"run-config key '{key}' = {value!r} needs adversary-training = 'server' (got "
                    f"{self.adversary_training!r}, whose per-client h_w is never aggregated); set {key} = '{off}'"
                )
        if str(self.adversary_class_prior).strip() == "aggregate" and not server:
            raise ConfigError(
                "run-config key 'adversary-class-prior' = 'aggregate' needs adversary-training = 'server' (the server "
                f"counts the classes from the round's summed statistics; got {self.adversary_training!r}); set it "
                "to '' (none) or to public shares, e.g. '0.3,0.7'"
            )
        if self.adversary_weight_rule == "adaptive" and str(self.strategy).startswith("flwr.serverapp.strategy:"):
            raise ConfigError(
                f"adversary-weight-rule = 'adaptive' needs one of this package's strategies (item-fedavg, "
                f"server-optimizer, ...): a Flower strategy ({self.strategy!r}) builds its own train messages, "
                "which do not carry the round's eps; set adversary-weight-rule = 'fixed'"
            )
        shares = self.secure_aggregation_num_shares
        if shares and (shares < 3 or shares % 2 == 0):
            raise ConfigError(
                f"run-config key 'secure-aggregation-num-shares' = {shares}: must be 0 (every sampled node) or an odd "
                "number >= 3 (the neighbourhood is centred on the node)"
            )
        if self.adversary_weight_rule == "adaptive" and not (
            self.adaptive_epsilon_min <= self.adversary_epsilon <= self.adaptive_epsilon_max
        ):
            raise ConfigError(
                f"adversary-weight-rule = 'adaptive' starts at adversary-epsilon = {self.adversary_epsilon!r}, which "
                f"must lie in [adaptive-epsilon-min, adaptive-epsilon-max] = [{self.adaptive_epsilon_min!r}, "
                f"{self.adaptive_epsilon_max!r}]"
            )
