"""The run configuration: one typed, validated object built once from Flower's ``run_config``.

Every key and its default is declared once, in ``[tool.flwr.app.config]`` of ``pyproject.toml`` (kebab-case, one
comment per key). This module gives each key its Python type and its constraints, and turns a mapping (Flower's
``context.run_config``) into a frozen :class:`RunConfig`. Unknown keys, missing keys, ill-typed values and values out of
range raise :class:`~fedrec_flwr.errors.ConfigError` naming the key and the value.

Outside Flower (tests, notebooks, experiment scripts), :func:`default_run_config` reads the defaults from the project's
``pyproject.toml`` and :func:`make_run_config` overrides some of them.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flwr.app import DEFAULT_TTL

from fedrec_flwr.errors import ConfigError

INT_MAX = 2**31 - 1
"""The largest value of any integer key (and of each entry of ``ks``, ``mlp-layers`` and ``forget-users``) unless
the key has a smaller maximum: every integer the run uses then fits numpy's and torch's int32/int64 and C ``long``
(an unchecked ``forget-users = "10000000000000000000"`` ended in a raw ``OverflowError``)."""

MESSAGE_TTL = float(DEFAULT_TTL)
"""The lifetime of every message our apps send, seconds: Flower's ``flwr.app.DEFAULT_TTL`` (43200 = 12 hours in flwr
1.42, ``flwr/app/constants.py``), which ``Message(..., ttl=None)`` uses. A ``round-timeout`` longer than this would wait
for replies to messages that have already expired, so it is refused."""

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
}
"""FedAU²'s adversary keys as its paper states the mechanism (and as the first release's package defaults had them):
FedAU²'s own selective unlearning trigger and gradient reversal, a 32-wide ``h_w``, one server step of 0.01 per round,
no class prior, DSVAE's noise on the head gradient only and drawn afresh for every upload. The package defaults are
the protective arm of ``experiments/fedau2`` (``pyproject.toml``; :mod:`fedrec_flwr.clients.fedau2`). Run-config overrides
(``make_run_config(**FIRST_RELEASE_ADVERSARY, ...)``, or as launcher ``key=value`` pairs): every arm of the FedAU²
experiment tables starts from them (``experiments.fedau2.methods.PROTOCOL``) and the mechanism tests pin them, so
their numbers stay those measured with these values."""

DATASETS: tuple[str, ...] = ("ml-100k", "filmtrust", "lastfm-2k", "amazon-video", "generic")
"""The values of ``dataset``: the four built-in real datasets (:mod:`fedrec_flwr.data.loaders`) and ``generic``, a
user's own CSV/TSV file."""

_CHOICES: dict[str, tuple[str, ...]] = {
    "dataset": DATASETS,
    "tie-rule": ("random", "fedrecgel", "smallest-item", "largest-item"),
    "model": ("ncf", "mf", "pfedrec"),
    "item-aggregation": ("auto", "touched", "selected"),
    "server-optimizer": ("adam", "sgd"),
    "loss": ("bce", "bpr"),
    "optimizer": ("sgd", "adam"),
    "adversary": ("none", "mlp", "dsvae"),
    "adversary-trigger": ("sut", "always"),
    "adversary-objective": ("reverse", "entropy"),
    "adversary-training": ("server", "per-client"),
    "adversary-server-optimizer": ("adam", "sgd"),
    "adversary-embedding-optimizer": ("local", "sgd"),
    "dsvae-noise-placement": ("head", "all"),
    "dsvae-noise-stream": ("per-user", "per-round", "per-upload"),
    "adversary-query-users": ("sampled", "all"),
    "unlearning": ("none", "retrain", "continue", "hfkcu", "gradient-ascent"),
    "krylov-mode": ("distributed", "local"),
    "krylov-solver": ("steihaug", "cg"),
    "krylov-preconditioner": ("none", "diagonal", "row"),
    "curvature": ("gauss-newton", "hessian"),
    "line-search": ("none", "remaining-loss", "membership-margin"),
    "block-training": ("auto", "on", "off"),
}


def _key(name: str, *, minimum: float | None = None, maximum: float | None = None, positive: bool = False) -> Any:
    return field(metadata={"key": name, "min": minimum, "max": maximum, "positive": positive})


@dataclass(frozen=True)
class RunConfig:
    """A validated run configuration. Attribute names are the kebab-case keys with ``-`` replaced by ``_``.

    See ``[tool.flwr.app.config]`` in ``pyproject.toml`` for the meaning and default of each key.
    """

    dataset: str = _key("dataset")
    data_dir: str = _key("data-dir")
    cache_dir: str = _key("cache-dir")
    generic_file: str = _key("generic-file")
    generic_columns: str = _key("generic-columns")
    generic_attributes_file: str = _key("generic-attributes-file")
    generic_attributes_user_column: str = _key("generic-attributes-user-column")
    min_user_interactions: int = _key("min-user-interactions", minimum=2)
    tie_rule: str = _key("tie-rule")
    holdout_validation: bool = _key("holdout-validation")
    num_test_negatives: int = _key("num-test-negatives", minimum=1)
    ks: str = _key("ks")
    model: str = _key("model")
    embedding_dim: int = _key("embedding-dim", minimum=1)
    mlp_layers: str = _key("mlp-layers")
    mlp_embedding_dim: int = _key("mlp-embedding-dim", minimum=0)
    loss: str = _key("loss")
    client: str = _key("client")
    local_epochs: int = _key("local-epochs", minimum=1)
    batch_size: int = _key("batch-size", minimum=1)
    learning_rate: float = _key("learning-rate", minimum=0.0)
    optimizer: str = _key("optimizer")
    num_train_negatives: int = _key("num-train-negatives", minimum=1)
    device: str = _key("device")
    rho_shared: float = _key("rho-shared", minimum=0.0)
    rho_private: float = _key("rho-private", minimum=0.0)
    item_learning_rate: float = _key("item-learning-rate", minimum=0.0)
    protected_attribute: str = _key("protected-attribute")
    adversary: str = _key("adversary")
    adversary_trigger: str = _key("adversary-trigger")
    adversary_objective: str = _key("adversary-objective")
    adversary_epsilon: float = _key("adversary-epsilon", minimum=0.0)
    adversary_training: str = _key("adversary-training")
    adversary_server_optimizer: str = _key("adversary-server-optimizer")
    adversary_server_learning_rate: float = _key("adversary-server-learning-rate", positive=True)
    adversary_server_steps: int = _key("adversary-server-steps", minimum=1, maximum=1000)
    adversary_query_users: str = _key("adversary-query-users")  # who answers h_w's extra-step queries
    adversary_embedding_optimizer: str = _key("adversary-embedding-optimizer")
    adversary_class_prior: str = _key("adversary-class-prior")
    adversary_hidden: int = _key("adversary-hidden", minimum=0)  # 0: a linear h_w (no hidden layer)
    adversary_warmup_rounds: int = _key("adversary-warmup-rounds", minimum=0)  # rounds 1..k: h_w learns, eps = 0
    dsvae_latent_dim: int = _key("dsvae-latent-dim", minimum=1)
    dsvae_kl_weight: float = _key("dsvae-kl-weight", minimum=0.0)
    dsvae_gradient_noise: float = _key("dsvae-gradient-noise", minimum=0.0)
    dsvae_noise_placement: str = _key("dsvae-noise-placement")  # server uploads: noise on the head only, or all of h_w
    dsvae_noise_stream: str = _key(
        "dsvae-noise-stream"
    )  # server uploads: one noise draw per user, per round, or per upload
    user_embedding_noise: float = _key("user-embedding-noise", minimum=0.0)
    unlearning: str = _key("unlearning")
    forget_users: str = _key("forget-users")
    forget_fraction: float = _key("forget-fraction", minimum=0.0, maximum=1.0)
    unlearn_round: int = _key("unlearn-round", minimum=0)
    krylov_mode: str = _key("krylov-mode")
    krylov_solver: str = _key("krylov-solver")
    krylov_preconditioner: str = _key("krylov-preconditioner")
    curvature: str = _key("curvature")
    trust_radius: float = _key("trust-radius", positive=True)
    cg_iterations: int = _key("cg-iterations", minimum=1)
    cg_tolerance: float = _key("cg-tolerance", minimum=0.0)
    damping: float = _key("damping", minimum=0.0)
    unlearn_scale: float = _key("unlearn-scale", positive=True)
    adaptive_scale: bool = _key("adaptive-scale")
    unlearn_max_step: float = _key("unlearn-max-step", positive=True)
    line_search: str = _key("line-search")
    line_search_max_step: float = _key("line-search-max-step", minimum=8.0)
    line_search_rounds: int = _key("line-search-rounds", minimum=1, maximum=20)
    curvature_sample: float = _key("curvature-sample", positive=True, maximum=1.0)
    causal_weighting: bool = _key("causal-weighting")
    ascent_steps: int = _key("ascent-steps", minimum=1)
    ascent_learning_rate: float = _key("ascent-learning-rate", positive=True)
    continue_rounds: int = _key("continue-rounds", minimum=1)
    strategy: str = _key("strategy")
    strategy_args: str = _key("strategy-args")
    plugin_config: str = _key("plugin-config")
    num_server_rounds: int = _key("num-server-rounds", minimum=1)
    fraction_train: float = _key("fraction-train", positive=True, maximum=1.0)
    fraction_evaluate: float = _key("fraction-evaluate", minimum=0.0, maximum=1.0)
    item_aggregation: str = _key("item-aggregation")
    server_optimizer: str = _key("server-optimizer")
    server_learning_rate: float = _key("server-learning-rate", positive=True)
    evaluate_validation: bool = _key("evaluate-validation")
    min_train_fraction: float = _key("min-train-fraction", minimum=0.0, maximum=1.0)
    eval_every: int = _key("eval-every", minimum=1)
    round_timeout: float = _key("round-timeout", positive=True, maximum=MESSAGE_TTL)
    max_in_flight: int = _key("max-in-flight", minimum=0)
    fast_link_state: bool = _key("fast-link-state")
    users_per_node: int = _key("users-per-node", minimum=1)
    block_training: str = _key("block-training")
    seed: int = _key("seed", minimum=0)
    client_state_dir: str = _key("client-state-dir")
    checkpoint_every: int = _key("checkpoint-every", minimum=0)
    resume_from: str = _key("resume-from")
    resume_resets_client_state: bool = _key("resume-resets-client-state")
    max_update_norm: float = _key("max-update-norm", minimum=0.0)
    results_dir: str = _key("results-dir")
    run_name: str = _key("run-name")
    extra: Mapping[str, Any] = field(default_factory=dict, metadata={"key": None})
    """Keys declared by plug-in clients or strategies (see :func:`register_extra_keys`), validated by them."""

    # ------------------------------------------------------------------------------------------------ derived values
    @property
    def k_values(self) -> tuple[int, ...]:
        """The cut-offs of ``ks`` as integers, e.g. ``(5, 10, 20)``."""
        return _int_list("ks", self.ks)

    @property
    def mlp_layer_sizes(self) -> tuple[int, ...]:
        """The NCF tower sizes of ``mlp-layers`` as integers, e.g. ``(64, 32, 16)``."""
        return _int_list("mlp-layers", self.mlp_layers)

    @property
    def forget_user_ids(self) -> tuple[int, ...]:
        """The user indices of ``forget-users`` (sorted, unique), e.g. ``(3, 17)``; ``()`` when empty (the split's
        user order: with ``users-per-node`` 1 a user's index is its node's ``partition-id``)."""
        parts = [p.strip() for p in str(self.forget_users).split(",") if p.strip()]
        try:
            values = sorted({int(p) for p in parts})
        except ValueError:
            raise ConfigError(
                f"run-config key 'forget-users' = {self.forget_users!r}: expected comma-separated "
                'user indices in one string, e.g. forget-users="3,17" (--run-config) or '
                "forget-users=3,17 (the launcher); not a TOML array"
            ) from None
        if values and values[0] < 0:
            raise ConfigError(f"run-config key 'forget-users' = {self.forget_users!r}: user indices are >= 0")
        if values and values[-1] > INT_MAX:
            raise ConfigError(
                f"run-config key 'forget-users' = {self.forget_users!r}: user index {values[-1]} is "
                f"out of range (at most {INT_MAX})"
            )
        return tuple(values)

    @property
    def generic_column_names(self) -> tuple[str, str, str | None, str | None]:
        """``generic-columns`` as ``(user, item, rating or None, timestamp or None)``: header names of the generic
        file, matched to the roles user, item, rating, timestamp.

        A name that is itself a role's name (``user``, ``item``, ``rating``, ``timestamp``, any case) takes that role
        wherever it stands, so ``"user,item,timestamp"`` (a file without ratings, its header listed) reads the
        ``timestamp`` column as timestamps. Every other name takes the role of its position,
        ``user,item[,rating[,timestamp]]``: ``"uid,iid,,ts"`` gives ``("uid", "iid", None, "ts")``.

        Raises:
            ConfigError: fewer than 2 or more than 4 names, a name used twice, two names for one role (naming both),
                or no user or item column.
        """
        roles = ("user", "item", "rating", "timestamp")
        columns = [c.strip() for c in str(self.generic_columns).split(",")]
        usage = (
            'give the header names of the user,item[,rating[,timestamp]] columns (e.g. "user,item,rating" '
            'for a file without timestamps, "uid,iid,,ts" for one without ratings)'
        )
        if len(columns) < 2 or len(columns) > 4:
            raise ConfigError(f"run-config key 'generic-columns' = {self.generic_columns!r}: {usage}")
        named = [c for c in columns if c]
        if len(set(named)) != len(named):
            raise ConfigError(f"run-config key 'generic-columns' = {self.generic_columns!r}: a column is named twice")
        chosen: dict[str, str] = {}
        by_name = [c for c in columns if c.lower() in roles]
        for name in by_name:
            role = name.lower()
            if role in chosen:
                raise ConfigError(
                    f"run-config key 'generic-columns' = {self.generic_columns!r}: columns "
                    f"{chosen[role]!r} and {name!r} both name the {role} column"
                )
            chosen[role] = name
        for position, name in enumerate(columns):
            if not name or name in by_name:
                continue
            role = roles[position]
            if role in chosen:
                raise ConfigError(
                    f"run-config key 'generic-columns' = {self.generic_columns!r}: column {name!r} is "
                    f"in the {role} position (position {position + 1} of user,item,rating,timestamp), "
                    f"but column {chosen[role]!r} names the {role} column by its name; {usage}"
                )
            chosen[role] = name
        for role in ("user", "item"):
            if role not in chosen:
                raise ConfigError(
                    f"run-config key 'generic-columns' = {self.generic_columns!r}: no {role} column; {usage}"
                )
        return chosen["user"], chosen["item"], chosen.get("rating"), chosen.get("timestamp")

    def generic_files(self) -> tuple[Path, Path | None]:
        """The generic dataset's ``(interactions file, attributes file or None)`` on this machine.

        A ``data-dir`` that is a file is the interactions file itself; one that is a folder is where relative
        ``generic-file`` / ``generic-attributes-file`` paths are resolved; empty: they resolve against the working
        directory (``$FEDREC_DATA_DIR`` is not used for generic data).

        Raises:
            ConfigError: the interactions or attributes file does not exist (the message names the key, the value
                and the resolved path), ``data-dir`` does not exist, or names a file while ``generic-file`` names
                another.
        """
        base_text = self.data_dir
        base = Path(base_text).expanduser() if base_text else None
        key_of_base = "data-dir"
        if base is not None and not base.exists():
            raise ConfigError(f"run-config key '{key_of_base}' = {base_text!r}: no such file or folder")
        if base is not None and base.is_file():
            if self.generic_file and Path(self.generic_file).expanduser().resolve() != base.resolve():
                raise ConfigError(
                    f"run-config key '{key_of_base}' = {base_text!r} is a file, so it is the "
                    f"interactions file, but 'generic-file' = {self.generic_file!r} names another; "
                    "set one of them, or make data-dir the folder holding generic-file"
                )
            interactions, folder = base, base.parent
        else:
            if not self.generic_file:
                raise ConfigError(
                    f"run-config key 'generic-file' is empty and 'data-dir' = {base_text!r} is a "
                    "folder: name the interactions file in 'generic-file' (relative to data-dir)"
                )
            interactions, folder = _resolve(self.generic_file, base), base
        if not interactions.is_file():
            raise ConfigError(
                f"run-config key 'generic-file' = {self.generic_file!r}: file {str(interactions)!r} "
                "not found" + (f" (resolved against data-dir {base_text!r})" if base is not None else "")
            )
        attributes = None
        if self.generic_attributes_file:
            attributes = _resolve(self.generic_attributes_file, folder)
            if not attributes.is_file():
                raise ConfigError(
                    f"run-config key 'generic-attributes-file' = {self.generic_attributes_file!r}: file "
                    f"{str(attributes)!r} not found"
                    + (f" (resolved against data-dir {base_text!r})" if folder is not None else "")
                )
        return interactions, attributes

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
        base = self.data_dir if data_dir is None else (data_dir or "")
        if self.dataset == "generic":
            self.generic_files()
        elif base:
            path = Path(base).expanduser()
            key = "data-dir" if base == self.data_dir else "data-dir ($FEDREC_DATA_DIR)"
            if not path.exists():
                raise ConfigError(
                    f"run-config key '{key}' = {base!r}: no such folder (it should hold the "
                    f"{self.dataset} files, or a '{self.dataset}' folder with them)"
                )
            if not path.is_dir():
                raise ConfigError(
                    f"run-config key '{key}' = {base!r} is a file; for dataset = {self.dataset!r} it "
                    "must be the folder holding the dataset's files"
                )
        if (
            self.cache_dir
            and Path(self.cache_dir).expanduser().exists()
            and not Path(self.cache_dir).expanduser().is_dir()
        ):
            raise ConfigError(f"run-config key 'cache-dir' = {self.cache_dir!r} is a file, not a folder")
        if self.device.startswith("cuda"):  # the clients train here: the device must exist here
            import torch

            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            index = int(self.device.split(":")[1]) if ":" in self.device else 0
            if index >= count:
                raise ConfigError(
                    f"run-config key 'device' = {self.device!r}: this machine has {count} CUDA "
                    "device(s); use 'cpu' or 'auto'"
                )

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
        extra = {key: mapping[key] for key in _EXTRA_KEYS if key in mapping}
        extra.update(_plugin_values(declared, mapping, values.get("plugin_config", "")))
        config = cls(**values, extra=extra)
        config._check_relations()
        return config

    def _check_relations(self) -> None:
        for key in (
            "dataset",
            "tie-rule",
            "model",
            "loss",
            "optimizer",
            "item-aggregation",
            "server-optimizer",
            "adversary",
            "adversary-trigger",
            "adversary-objective",
            "adversary-training",
            "adversary-server-optimizer",
            "adversary-embedding-optimizer",
            "adversary-query-users",
            "dsvae-noise-placement",
            "dsvae-noise-stream",
            "unlearning",
            "krylov-mode",
            "krylov-solver",
            "krylov-preconditioner",
            "curvature",
            "line-search",
            "block-training",
        ):
            value = getattr(self, key.replace("-", "_"))
            if value not in _CHOICES[key]:
                raise ConfigError(f"run-config key '{key}' = {value!r}: must be one of {list(_CHOICES[key])}")
        ks = self.k_values
        if not ks:
            raise ConfigError("run-config key 'ks' = '': give at least one cut-off, e.g. \"5,10,20\"")
        if len(set(ks)) != len(ks):
            raise ConfigError(f"run-config key 'ks' = {self.ks!r}: a cut-off is given twice; give each K once")
        if max(ks) > self.num_test_negatives + 1:
            raise ConfigError(
                f"run-config key 'ks' = {self.ks!r}: K may not exceed the {self.num_test_negatives + 1} ranked candidates"
            )
        if self.model == "ncf":
            self.mlp_layer_sizes  # noqa: B018 - validates
        if self.dataset == "generic":
            if not self.generic_file and not self.data_dir:
                raise ConfigError(
                    "run-config key 'generic-file' is empty but dataset = 'generic' needs the "
                    "interactions file: set 'generic-file' (relative paths resolve against 'data-dir'), "
                    "or set 'data-dir' to the file itself"
                )
            self.generic_column_names  # noqa: B018 - validates
            if self.generic_attributes_user_column and not self.generic_attributes_file:
                raise ConfigError(
                    f"run-config key 'generic-attributes-user-column' = "
                    f"{self.generic_attributes_user_column!r} is set but 'generic-attributes-file' is "
                    "empty: name the attributes file, or leave the key empty"
                )
            if (
                self.generic_attributes_user_column != self.generic_attributes_user_column.strip()
                or "," in self.generic_attributes_user_column
            ):
                raise ConfigError(
                    f"run-config key 'generic-attributes-user-column' = "
                    f"{self.generic_attributes_user_column!r}: give one column name of the attributes "
                    "file's header, without surrounding spaces or commas"
                )
        elif self.generic_file or self.generic_attributes_file or self.generic_attributes_user_column:
            key = (
                "generic-file"
                if self.generic_file
                else "generic-attributes-file"
                if self.generic_attributes_file
                else "generic-attributes-user-column"
            )
            raise ConfigError(
                f"run-config key '{key}' is set but dataset = {self.dataset!r} does not read it "
                "(it is for dataset = 'generic')"
            )
        need = 3 if self.holdout_validation else 2
        if self.min_user_interactions < need:
            raise ConfigError(
                f"run-config key 'min-user-interactions' = {self.min_user_interactions}: must be >= {need} (the "
                f"held-out item{'s' if need == 3 else ''} plus at least one training positive"
                + (", with holdout-validation = true)" if need == 3 else ")")
            )
        if not (self.device in ("cpu", "cuda", "auto") or re.fullmatch(r"cuda:\d+", self.device)):
            raise ConfigError(f"run-config key 'device' = {self.device!r}: must be cpu, cuda, cuda:N or auto")
        if self.evaluate_validation and not self.holdout_validation:
            raise ConfigError("run-config key 'evaluate-validation' = true needs 'holdout-validation' = true")
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
        forget = self.forget_user_ids  # validates the list
        if self.unlearning != "none" and not forget and self.forget_fraction == 0:
            raise ConfigError(
                f"run-config key 'unlearning' = {self.unlearning!r} needs users to forget: set "
                "'forget-users' (user indices) or 'forget-fraction'"
            )
        if self.unlearn_round > self.num_server_rounds:
            raise ConfigError(
                f"run-config key 'unlearn-round' = {self.unlearn_round} is after the last round "
                f"(num-server-rounds = {self.num_server_rounds})"
            )
        if self.unlearning == "hfkcu" and self.krylov_mode == "local" and self.damping == 0:
            raise ConfigError(
                "run-config key 'damping' = 0 with krylov-mode = 'local': one user's Hessian is singular "
                "(zero on every row it never touches); set damping > 0"
            )
        if self.krylov_preconditioner != "none" and (
            self.krylov_solver != "steihaug" or self.krylov_mode != "distributed"
        ):
            raise ConfigError(
                f"run-config key 'krylov-preconditioner' = {self.krylov_preconditioner!r} needs "
                f"krylov-solver = 'steihaug' and krylov-mode = 'distributed', got {self.krylov_solver!r} "
                f"and {self.krylov_mode!r}; or set it to 'none'"
            )
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


def _resolve(name: str, folder: Path | None) -> Path:
    path = Path(name).expanduser()
    return path if path.is_absolute() or folder is None else folder / path


def _int_list(key: str, text: str) -> tuple[int, ...]:
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
