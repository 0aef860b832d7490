"""What a FedAU² client uploads for the server's step of ``h_w`` (``adversary-training = "server"``, ours; the paper
does not say how ``h_w`` is aggregated): the gradient of the adversary's loss at the round's frozen global ``h_w`` and
the user's trained embedding, with DSVAE's label-masking noise on it (:func:`adversary_gradient`), and the same mean
over many users in one batched pass (:func:`mean_adversary_gradient`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fedrec_flwr.adversary.models import (
    ADVERSARY_MODULE,
    AttributeAdversary,
    DSVAEAdversary,
    adversary_of,
    user_vector,
)
from fedrec_flwr.adversary.prior import adjusted_ce
from fedrec_flwr.models.base import RecModel

TRAININGS = ("server", "per-client")
"""How ``h_w`` is trained (``adversary-training``): ``"server"``, the round's global ``h_w`` frozen on every client and
stepped by the server on the clients' averaged gradients (:func:`adversary_gradient`,
:class:`fedrec_flwr.strategies.adversary.AdversaryServerStep`); ``"per-client"``, FedAU² as first implemented: each client trains
its local copy of ``h_w`` on its own label with its local optimizer, and the strategy averages the copies (FedAvg)."""
NOISE_PLACEMENTS = ("head", "all")
"""Which parameters' uploaded gradients get DSVAE's label-masking noise (``dsvae-noise-placement``, server training):
``"head"``, the last layer only (as first built: iDLG reads the head's bias gradient ``p - onehot(a)``), or ``"all"``
(ours): every parameter of ``h_w``, since the encoder's gradient carries ``W_head^T (p - onehot(a))``
unperturbed and DLG's gradient matching reads the label from it (measured: DLG 1.00 with ``"head"``)."""


def adversary_gradient(
    model: RecModel,
    *,
    label: int,
    kl_weight: float,
    generator: torch.Generator,
    log_prior: torch.Tensor | None = None,
    noise_placement: str = "head",
    noise_generator: torch.Generator | None = None,
) -> dict[str, torch.Tensor]:
    """One user's contribution to the server's step of ``h_w`` (``adversary-training = "server"``, ours; the paper
    does not say how ``h_w`` is aggregated): the gradient of ``CE(h_w(e_u), a) [+ kl_weight * KL]`` with respect to
    ``h_w``'s parameters, at the model's current ``h_w`` (the round's global copy, which the frozen local training
    left unchanged) and the user's embedding after this round's local training (detached: no gradient reaches it).

    For a DSVAE adversary this is one training forward: the latent is sampled (randomness 1) and the last layer's
    gradient gets one ``N(0, noise^2)`` draw (randomness 2, :class:`DSVAEAdversary`), so the label-masking noise is
    on exactly what the server sees, once per upload (not at every local step). Without DSVAE the gradient of a
    single-label cross-entropy names the label (iDLG: the bias gradient ``p - onehot(a)`` is negative only at ``a``);
    that is the residual leakage the DSVAE noise must mask (measured by the curious server, experiments/fedau2).

    ``noise_placement = "all"`` (``dsvae-noise-placement``, ours): every other parameter's gradient (the encoder's)
    also gets one ``N(0, noise^2)`` draw per entry from the same generator, after the head's; ``"head"``: only the
    head's, as first built. Without DSVAE (``gradient_noise`` absent) the placement changes nothing.

    ``noise_generator`` (``dsvae-noise-stream``, ours): the gradient noise (head and encoder) comes from it, the latent
    from ``generator``; a client seeds it from ``(user)`` or ``(user, round)`` alone, so every upload of the user (of
    the round) carries the same noise, and the mean of a user's uploads keeps the noise of one (a server linking a
    node's uploads learns no more than from one, :class:`fedrec_flwr.strategies.curious.LabelLeakageAudit`). ``None``: both from
    ``generator``, a fresh draw per upload (as first built).

    Returns:
        shared key (``"adversary.<name>"``) -> gradient, shaped as the parameter.

    Raises:
        ValueError: the model has no adversary, ``label`` is outside its classes or an unknown placement.
    """
    adversary = adversary_of(model)
    if adversary is None:
        raise ValueError("adversary_gradient: the model has no adversary module")
    if not 0 <= int(label) < adversary.num_classes:
        raise ValueError(f"adversary_gradient: label {label} outside [0, {adversary.num_classes})")
    return mean_adversary_gradient(
        adversary,
        user_vector(model),
        torch.tensor([int(label)]),
        log_prior=log_prior,
        kl_weight=kl_weight,
        generators=[generator],
        noise_placement=noise_placement,
        noise_generators=[noise_generator],
    )


def _check_placement(noise_placement: str) -> None:
    if noise_placement not in NOISE_PLACEMENTS:
        raise ValueError(f"dsvae-noise-placement must be one of {NOISE_PLACEMENTS}, got {noise_placement!r}")


def _encoder_noise(
    adversary: nn.Module,
    generator: torch.Generator,
    noise_placement: str,
    encoder: list[tuple[str, torch.Size, torch.device]] | None = None,
) -> dict[str, torch.Tensor]:
    """``dsvae-noise-placement = "all"``'s draws for one upload: ``N(0, noise^2)`` per entry of every parameter of a
    DSVAE ``h_w`` but the head's (whose noise :meth:`DSVAEAdversary.forward` drew), in ``named_parameters`` order,
    from ``generator`` after the forward's draws; ``{}`` for ``"head"``, a plain ``h_w`` or ``noise = 0``.
    ``encoder``: :func:`_encoder_parameters` of ``adversary``, if already listed."""
    noise = float(getattr(adversary, "gradient_noise", 0.0))
    if noise_placement != "all" or noise <= 0:
        return {}
    return {
        key: noise * torch.randn(shape, generator=generator).to(device)
        for key, shape, device in (encoder if encoder is not None else _encoder_parameters(adversary))
    }


def _encoder_parameters(adversary: nn.Module) -> list[tuple[str, torch.Size, torch.device]]:
    """``(shared key, shape, device)`` of every parameter of ``h_w`` but the head's, in ``named_parameters`` order."""
    return [
        (f"{ADVERSARY_MODULE}.{name}", p.shape, p.device)
        for name, p in adversary.named_parameters()
        if not name.startswith("head.")
    ]


def mean_adversary_gradient(
    adversary: nn.Module,
    vectors: torch.Tensor,
    labels: torch.Tensor,
    *,
    log_prior: torch.Tensor | None = None,
    kl_weight: float = 0.0,
    generators: Sequence[torch.Generator] | None = None,
    noise_placement: str = "head",
    noise_generators: Sequence[torch.Generator | None] | None = None,
) -> dict[str, torch.Tensor]:
    """The mean over ``n`` users of :func:`adversary_gradient`, in one batched computation (ours, for speed: a
    node answers each of the ``S - 1`` ``adversary_gradient`` queries of a round for all its users at once; the
    per-user loop costs about 1 ms per user and query).

    Each user's loss ``CE(h_w(e_u) [+ log_prior], a_u) [+ kl_weight * KL_u]`` depends on that user alone, so the mean
    of the per-user gradients is the gradient of the mean loss. A DSVAE ``h_w`` also draws per user: its latent
    ``xi_u`` and its head perturbations (:meth:`DSVAEAdversary.draw`), then, with ``noise_placement = "all"``, the
    encoder's, each from the user's own ``generators[u]`` in the order the per-user forward draws them; the batched
    forward takes every ``xi_u`` and the *mean* of the head perturbations (a constant added to the gradient: the mean
    of the per-user sums), and the encoder's mean perturbation is added after. Equal to the mean of the per-user
    :func:`adversary_gradient` calls up to float summation order (tested for both adversaries).

    Args:
        adversary: an :class:`AttributeAdversary` or a :class:`DSVAEAdversary`.
        vectors: ``(n, D)`` users' embeddings (:func:`user_vector` rows; detached here). labels: ``(n,)`` classes.
        kl_weight: DSVAE's ``dsvae-kl-weight`` (its KL term is per user, so the mean's is the batch's mean).
        generators: DSVAE only: ``n`` seeded generators, user ``u``'s stream for this upload.
        noise_placement: ``dsvae-noise-placement``.
        noise_generators: DSVAE only: ``n`` streams of the users' gradient noise (``dsvae-noise-stream``, as in
            :func:`adversary_gradient`), or ``None`` (each from its ``generators`` entry after the latent).

    Returns:
        shared key (``"adversary.<name>"``) -> mean gradient, shaped as the parameter.

    Raises:
        ValueError: another adversary, no users, shapes that do not match, a label outside the classes, a DSVAE
            adversary without one generator per user, or an unknown placement.
    """
    if not isinstance(adversary, (AttributeAdversary, DSVAEAdversary)):
        raise ValueError(
            f"mean_adversary_gradient: needs an AttributeAdversary or a DSVAEAdversary, got {type(adversary).__name__}"
        )
    _check_placement(noise_placement)
    labels = torch.as_tensor(labels, dtype=torch.long, device=adversary.head.weight.device)
    if vectors.dim() != 2 or len(vectors) == 0 or labels.shape != (len(vectors),):
        raise ValueError(
            f"mean_adversary_gradient: vectors (n, D) with n >= 1 and labels (n,), got "
            f"{tuple(vectors.shape)} and {tuple(labels.shape)}"
        )
    if int(labels.min()) < 0 or int(labels.max()) >= adversary.num_classes:
        raise ValueError(f"mean_adversary_gradient: labels outside [0, {adversary.num_classes})")
    names, params = zip(*adversary.named_parameters())
    extra: dict[str, torch.Tensor] = {}
    if isinstance(adversary, DSVAEAdversary):
        if generators is None or len(generators) != len(vectors):
            raise ValueError(
                f"mean_adversary_gradient: a DSVAE adversary needs one generator per user ({len(vectors)}),"
                f" got {None if generators is None else len(generators)}"
            )
        head_noise = adversary.gradient_noise > 0 and adversary.head.weight.requires_grad
        draws, encoder, listed = [], [], _encoder_parameters(adversary)
        noise_generators = [None] * len(generators) if noise_generators is None else list(noise_generators)
        if len(noise_generators) != len(generators):
            raise ValueError(
                f"mean_adversary_gradient: {len(noise_generators)} noise generators for {len(generators)} users"
            )
        for generator, noise in zip(generators, noise_generators):  # each user's draws in the per-user order
            draws.append(adversary.draw(generator, 1, head_noise=head_noise, noise_generator=noise))
            encoder.append(_encoder_noise(adversary, generator if noise is None else noise, noise_placement, listed))
        xi = torch.cat([d[0] for d in draws])
        mean_of = lambda tensors: torch.stack(tensors).mean(dim=0)
        head = (mean_of([d[1] for d in draws]), mean_of([d[2] for d in draws])) if head_noise else (None, None)
        logits = adversary(vectors.detach(), draws=(xi, *head))
        loss = adjusted_ce(logits, labels, log_prior) + kl_weight * adversary.regulariser()
        extra = {key: mean_of([e[key] for e in encoder]) for key in encoder[0]}
    else:
        loss = adjusted_ce(adversary(vectors.detach()), labels, log_prior)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    out = {
        f"{ADVERSARY_MODULE}.{name}": torch.zeros_like(p) if g is None else g.detach()
        for name, p, g in zip(names, params, grads)
    }
    for key, noise in extra.items():
        out[key] = out[key] + noise
    return out
