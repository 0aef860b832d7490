"""The adversary's class prior (``adversary-class-prior``) and the logit-adjusted cross-entropy it enters.

With a prior ``pi``, ``h_w`` trains on ``CE(h_w(e) + log pi, a)`` (Menon et al. 2021, "Long-tail learning via logit
adjustment", Eq. 10), so the raw ``argmax`` of ``h_w``'s logits is the balanced decision: the SUT then fires for
minority-class users as often as for the majority's, instead of ``h_w`` predicting the majority class for everyone.

``adversary-class-prior = "aggregate"`` (the default) needs no published shares: the server estimates ``pi`` from the
per-class user counts it already receives summed over each round's users (the ``users`` block of
:func:`fedrec_flwr.adversary.adaptive.adversary_statistics`, under SecAgg+ only their sum over the round's nodes), as
``pi_c = (n_c + 1) / (N + C)`` over every round so far (add-one smoothing: a class not yet seen keeps a positive
share), and sends it in each train and ``adversary_gradient`` message (:data:`MESSAGE_PRIOR_KEY`); round 1, before
any count, trains without a prior. It is the same statistic as a published class share, counted securely from the
federation instead of read from a paper, so it transfers to data that has none (a generic attributes file).
"""

from __future__ import annotations

import functools
import logging
import math

import torch
import torch.nn.functional as F

from fedrec_flwr.attributes import published_class_prior

log = logging.getLogger(__name__)

AGGREGATE = "aggregate"
"""``adversary-class-prior`` value: the prior estimated by the server from the summed class counts (module docstring)."""
MESSAGE_PRIOR_KEY = "adversary-class-shares"
"""Train / ``adversary_gradient`` message config key: the round's class shares under ``"aggregate"`` (comma text)."""


def uses_aggregate_prior(config) -> bool:
    """Whether the run config's ``adversary-class-prior`` is ``"aggregate"`` (the server's counted shares)."""
    return str(config.adversary_class_prior).strip() == AGGREGATE


def aggregate_shares(counts) -> str:
    """The add-one smoothed shares ``(n_c + 1) / (N + C)`` of per-class user counts ``counts`` ``(C,)`` as the comma
    text :func:`parse_class_prior` reads (``repr`` floats, so the clients rebuild the server's value exactly)."""
    counts = [max(float(c), 0.0) for c in counts]
    total = sum(counts) + len(counts)
    return ",".join(repr((c + 1.0) / total) for c in counts)


def round_prior_text(config, message_config, classes: tuple[str, ...] | None = None) -> str:
    """The prior text of one message: under ``"aggregate"`` the shares the server sent in ``message_config``
    (:data:`MESSAGE_PRIOR_KEY`; ``""`` before the first counts), else :func:`class_prior_text`."""
    if uses_aggregate_prior(config):
        return str((message_config or {}).get(MESSAGE_PRIOR_KEY, ""))
    return class_prior_text(config, classes)


def adjusted_ce(logits: torch.Tensor, target: torch.Tensor, log_prior: torch.Tensor | None) -> torch.Tensor:
    """``CE(logits + log_prior, target)``: with a class prior, the logit-adjusted loss of Menon et al. (2021, "Long-tail
    learning via logit adjustment", Eq. 10), whose minimiser's raw ``argmax`` is the balanced (prior-free) decision."""
    return F.cross_entropy(logits if log_prior is None else logits + log_prior, target)


def class_prior_text(config, classes: tuple[str, ...] | None = None, *, warn: bool = False) -> str:
    """``adversary-class-prior`` as shares: ``"published"`` (the default) resolves to the dataset's published class
    shares (:func:`fedrec_flwr.attributes.published_class_prior`: MovieLens-100K's gender, age and occupation), or to
    ``""`` (no prior) for a dataset / attribute without published shares, a generic attributes file for instance; any
    other value is returned as given.

    Args:
        config: the run config (``adversary_class_prior``, ``dataset``, ``protected_attribute``).
        classes: the split's encoded classes, if known (checked against the published ones).
        warn: log a warning when ``"published"`` falls back to no prior (the client's config check does, once).

    Raises:
        ConfigError: the split's classes differ from the published ones.
    """
    text = str(config.adversary_class_prior).strip()
    if text == AGGREGATE:  # no static prior: each message carries the server's estimate (round_prior_text)
        return ""
    if text != "published":
        return text
    shares = published_class_prior(config.dataset, config.protected_attribute, classes)
    if shares is None:
        if warn:
            log.warning(
                "adversary-class-prior = 'published': no published class shares for protected-attribute = "
                "%r of dataset = %r, so h_w trains without a prior (its decision leans to the majority "
                "class); give public shares, e.g. '0.3,0.7', in class order (the attribute's sorted values; "
                "age: its age groups), to balance it",
                config.protected_attribute,
                config.dataset,
            )
        return ""
    return shares


@functools.lru_cache(maxsize=64)
def parse_class_prior(text: str, num_classes: int) -> torch.Tensor | None:
    """``adversary-class-prior``: ``""`` -> ``None``; ``"0.71,0.29"`` -> ``(C,)`` log-probabilities (normalised).

    Cached: every user's train step and ``adversary_gradient`` query asks for it (19 queries a round at the
    defaults), so the same tensor is returned each time; callers only add it to logits and must not change it.

    Raises:
        ValueError: not ``C`` comma-separated positive finite numbers (the message names the key and value).
    """
    if not str(text).strip():
        return None
    try:
        values = [float(v) for v in str(text).split(",")]
    except ValueError:
        raise ValueError(
            f"run-config key 'adversary-class-prior' = {text!r}: expected comma-separated numbers"
        ) from None
    if len(values) != num_classes or not all(math.isfinite(v) and v > 0 for v in values):
        raise ValueError(
            f"run-config key 'adversary-class-prior' = {text!r}: expected {num_classes} positive numbers "
            f"(one per class of the protected attribute)"
        )
    prior = torch.tensor(values, dtype=torch.float32)
    return torch.log(prior / prior.sum())
