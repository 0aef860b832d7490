"""Per-process objects both apps need: the validated config, the dataset split, and the model template.

Flower runs many nodes' messages in one worker process (a Ray actor in simulation, a SuperNode's ClientApp process in
deployment); building the split and the model once per process per configuration keeps a message cheap. Nothing
here holds per-user state: that lives in each node's ``context.state``.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedrec_flwr.attributes import AttributeLabels, encode_attribute
from fedrec_flwr.config import RunConfig
from fedrec_flwr.data import GenericSource, Split, load_split
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.local.training import LocalTrainConfig
from fedrec_flwr.models import RecModel, build_model
from fedrec_flwr.seeding import TAG_MODEL_INIT, torch_generator
from fedrec_flwr.wire import ModelLayout

log = logging.getLogger(__name__)

_SPLIT_CACHE: dict[tuple, Split] = {}
_LOCK = threading.Lock()


def load_split_for(config: RunConfig) -> Split:
    """Load (once per process) the split the config describes.

    Raises:
        ConfigError: a key naming a file or folder is wrong on this machine (:meth:`RunConfig.check_files`).
        DataError: the dataset's files are missing or malformed (see :func:`fedrec_flwr.data.load_split`).
    """
    config.check_files(data_dir_for(config))
    key = (
        config.dataset,
        config.data_dir,
        config.cache_dir,
        config.generic_file,
        config.generic_columns,
        config.generic_attributes_file,
        config.generic_attributes_user_column,
        config.min_user_interactions,
        config.tie_rule,
        config.seed,
        config.num_test_negatives,
        config.holdout_validation,
    )
    with _LOCK:
        if key not in _SPLIT_CACHE:
            _SPLIT_CACHE[key] = load_split(
                config.dataset,
                data_dir_for(config),
                cache_dir=config.cache_dir or None,
                generic=generic_source(config),
                min_user_interactions=config.min_user_interactions,
                tie_rule=config.tie_rule,
                seed=config.seed,
                num_test_negatives=config.num_test_negatives,
                holdout_validation=config.holdout_validation,
            )
        return _SPLIT_CACHE[key]


DATA_DIR_ENV = "FEDREC_DATA_DIR"
"""Environment variable naming a data folder (the dataset's own folder, or a parent holding ``<dataset>/``), used
when the run config's ``data-dir`` is empty. Only if neither is set are the files downloaded into the cache."""


def data_dir_for(config: RunConfig) -> str | None:
    """``data-dir`` if set, else ``$FEDREC_DATA_DIR`` if set, else ``None`` (download into the cache)."""
    return config.data_dir or os.environ.get(DATA_DIR_ENV) or None


def generic_source(config: RunConfig) -> GenericSource | None:
    """The :class:`GenericSource` of ``dataset = "generic"`` (``None`` for the named datasets); its files resolved as
    :meth:`RunConfig.generic_files` says (``data-dir`` is the file itself, or the folder relative names resolve in)."""
    if config.dataset != "generic":
        return None
    user, item, rating, timestamp = config.generic_column_names
    interactions, attributes = config.generic_files()
    return GenericSource(
        path=str(interactions),
        user_col=user,
        item_col=item,
        rating_col=rating,
        timestamp_col=timestamp,
        attributes_path=str(attributes) if attributes is not None else None,
        attributes_user_col=config.generic_attributes_user_column or None,
    )


def build_shared_model(config: RunConfig, num_items: int, num_users: int = 1, num_classes: int = 0) -> RecModel:
    """The configured model with ``num_users`` user rows, shared parameters initialised from the run's seed.

    With ``adversary`` set (FedAU²), an attribute adversary over ``num_classes`` classes is attached as a shared
    module (:mod:`fedrec_flwr.adversary`), initialised from its own stream so the rest of the model is unchanged.
    Every process that calls this with the same arguments gets bit-identical shared parameters.

    Raises:
        ConfigError: ``adversary`` is set but ``num_classes`` < 2, or the model has no user embedding.
    """
    model = build_model(
        config.model,
        num_users=num_users,
        num_items=num_items,
        embedding_dim=config.embedding_dim,
        mlp_layers=config.mlp_layer_sizes,
        mlp_embedding_dim=config.mlp_embedding_dim,
        seed=config.seed * 1000 + TAG_MODEL_INIT,
    )
    if config.adversary != "none":
        from fedrec_flwr.adversary import ADVERSARY_MODULE, build_adversary, user_vector_dim

        if num_classes < 2:
            raise ConfigError(
                f"run-config key 'adversary' = {config.adversary!r} needs the protected attribute's "
                f"classes (>= 2), got {num_classes}"
            )
        if not model.user_embedding_modules():
            raise ConfigError(
                f"run-config key 'adversary' = {config.adversary!r} needs a model with user embeddings "
                f"(mf or ncf), got model = {config.model!r}"
            )
        adversary = build_adversary(
            config.adversary,
            user_vector_dim(model),
            num_classes,
            hidden=config.adversary_hidden,
            latent=config.dsvae_latent_dim,
            gradient_noise=config.dsvae_gradient_noise,
            generator=torch_generator(config.seed, TAG_MODEL_INIT, 1),
        )
        model.attach_shared_module(ADVERSARY_MODULE, adversary)
    return model


def protected_labels(config: RunConfig, split: Split) -> AttributeLabels | None:
    """The split's ``protected-attribute`` as class labels (``None`` when the key is empty).

    Raises:
        ConfigError: the dataset has no such attribute, or it is unusable (:func:`encode_attribute`).
    """
    if not config.protected_attribute:
        return None
    return encode_attribute(split.attributes, config.protected_attribute)


def local_train_config(config: RunConfig) -> LocalTrainConfig:
    """The local-training part of the run config."""
    return LocalTrainConfig(
        local_epochs=config.local_epochs,
        batch_size=config.batch_size,
        learning_rate=config.learning_rate,
        num_train_negatives=config.num_train_negatives,
        loss=config.loss,
        optimizer=config.optimizer,
        device=config.device,
    )


@dataclass
class Runtime:
    """What a worker process holds for one configuration: config, split, a one-user model and its layout."""

    config: RunConfig
    split: Split
    model: RecModel
    layout: ModelLayout
    train_config: LocalTrainConfig
    loaded_shared: Any = None
    """The shared-parameter mapping last loaded into :attr:`model` (see
    :meth:`fedrec_flwr.clients.fedrec.FedRecClient.load_shared`)."""
    dirty_shared: set = field(default_factory=set)
    """Shared keys changed in :attr:`model` since :attr:`loaded_shared` was loaded."""
    protected: AttributeLabels | None = None
    """The users' ``protected-attribute`` labels (private data of each client; ``None`` without the key)."""
    derived: dict = field(default_factory=dict)
    """Facts derived once from :attr:`model` and :attr:`config` by the code that needs them on every message (e.g.
    :class:`fedrec_flwr.local.blocks.Block`'s private parameter shapes, with the model they were read from); never per-user
    state."""


_RUNTIMES: dict[tuple, Runtime] = {}
_LAST_RUNTIME: list = [None, None]
"""``[a copy of the run config last looked up, its Runtime]``: every message of a run carries the same config."""


def get_runtime(run_config: Mapping[str, Any] | RunConfig) -> Runtime:
    """The process-wide :class:`Runtime` for Flower's ``run_config`` (validated once, cached); a validated
    :class:`~fedrec_flwr.config.RunConfig` (``make_run_config(...)``) is taken as its mapping.

    The config of the previous call is kept: a message whose config equals it, value for value and type for type
    (``1``, ``1.0`` and ``True`` are equal in Python but not the same config), gets its runtime without the sorted
    key of every entry (a 91-key config took about 0.1 ms per message that way)."""
    if isinstance(run_config, RunConfig):
        run_config = run_config.to_dict()
    last, cached = _LAST_RUNTIME
    if cached is not None and run_config == last and all(type(v) is type(last[k]) for k, v in run_config.items()):
        return cached
    key = tuple(sorted((k, repr(v)) for k, v in run_config.items()))
    runtime = _RUNTIMES.get(key)
    if runtime is None:
        config = RunConfig.from_mapping(run_config)
        split = load_split_for(config)
        protected = protected_labels(config, split)
        model = build_shared_model(config, split.num_items, num_classes=protected.num_classes if protected else 0)
        runtime = Runtime(
            config, split, model, ModelLayout.from_model(model), local_train_config(config), protected=protected
        )
        _RUNTIMES[key] = runtime
        freeze_long_lived_objects()
    _LAST_RUNTIME[:] = [dict(run_config), runtime]
    return runtime


def forget_cached_data() -> None:
    """Drop this process's loaded splits and runtimes, so the next :func:`get_runtime` reads the data files again
    (a resume checks the data as they are now; the on-disk split cache is keyed by the files' sha256)."""
    with _LOCK:
        _SPLIT_CACHE.clear()
        _RUNTIMES.clear()
        _LAST_RUNTIME[:] = [None, None]


def freeze_long_lived_objects() -> None:
    """Move every object alive now (imported modules, the split, the model) out of the cyclic garbage collector's
    view (:func:`gc.freeze`): they live as long as the process, and each full collection would otherwise rescan them
    (measured: about half of the time of a vectorized block of 100 FedNCF users on ML-100K went to such collections;
    ours). Objects created later are collected as usual.

    No collection runs first: in a deployed SuperNode every message is a fresh ``flwr-clientapp`` process, and a full
    :func:`gc.collect` there cost 0.18 s per message while finding no unreachable object (measured on ML-100K after
    the runtime is built; ours). Anything unreachable at this point would stay frozen, never freed."""
    gc.freeze()


def node_users(config: RunConfig, node_config: Mapping[str, Any], num_users: int) -> range:
    """The contiguous block of users one node serves: ``partition-id * users-per-node`` onwards.

    Raises:
        ConfigError: ``partition-id`` is missing, not an integer, or out of range for the dataset.
    """
    if "partition-id" not in node_config:
        raise ConfigError(
            "node config has no 'partition-id' (start the SuperNode with "
            '--node-config "partition-id=<i> num-partitions=<N>")'
        )
    pid = node_config["partition-id"]
    if isinstance(pid, bool) or not isinstance(pid, int):
        raise ConfigError(f"node config 'partition-id' = {pid!r}: expected an integer")
    upn = config.users_per_node
    num_nodes = -(-num_users // upn)
    if not 0 <= pid < num_nodes:
        raise ConfigError(
            f"node config 'partition-id' = {pid} is out of range: {config.dataset} has {num_users} users, "
            f"users-per-node = {upn}, so partition ids run 0..{num_nodes - 1}"
        )
    return range(pid * upn, min((pid + 1) * upn, num_users))
