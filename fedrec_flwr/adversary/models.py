"""The attribute adversary ``h_w`` of FedAU² (arXiv:2511.22872): the plain MLP / linear adversary, the
dual-stochastic variational adversary (DSVAE), their factory, and the user vector they read.

The user embedding fed to ``h_w`` is the concatenation of the model's user-embedding rows (NCF: GMF and MLP
embeddings, ``2d``; MF: ``d``), :func:`user_vector`. The adversary is attached to the model as its shared module
:data:`ADVERSARY_MODULE`, so the server aggregates it like the score function.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from fedrec_flwr.adversary.grl import noisy_gradient
from fedrec_flwr.models.base import RecModel, init_linear, new_linear

ADVERSARY_MODULE = "adversary"
"""Name of the adversary's module in the model (its shared-state keys start with ``"adversary."``)."""


def user_vector(model: RecModel, row: int = 0) -> torch.Tensor:
    """The user's embedding as the adversary sees it: the concatenation of every user-embedding table's row ``row``.

    Returns:
        ``(1, D)`` tensor, differentiable w.r.t. the user tables (``D = d`` for MF, ``2d`` for NCF).
    """
    index = torch.tensor([row], dtype=torch.long, device=next(model.parameters()).device)
    return torch.cat([table(index) for table in model.user_embedding_modules().values()], dim=1)


def user_vectors(model: RecModel, private: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """:func:`user_vector` of several users at once: ``(n, D)`` from their stacked private parameters ``private``
    (key -> ``(n, 1, d)``, e.g. :meth:`fedrec_flwr.local.blocks.Block.load_private`), in the same table order."""
    return torch.cat([private[f"{name}.weight"][:, 0, :] for name in model.user_embedding_modules()], dim=1)


def user_vector_dim(model: RecModel) -> int:
    """``D`` of :func:`user_vector`."""
    return sum(t.embedding_dim for t in model.user_embedding_modules().values())


def _hidden_layer(in_dim: int, hidden: int) -> nn.Linear | None:
    """The first layer ``D -> hidden``, or ``None`` for ``hidden = 0`` (no hidden layer)."""
    if int(hidden) != hidden or hidden < 0:
        raise ValueError(f"adversary hidden width must be an integer >= 0, got {hidden!r}")
    return new_linear(in_dim, int(hidden)) if hidden else None


class AttributeAdversary(nn.Module):
    """The plain adversary ``h_w``: an MLP ``D -> hidden -> C`` (ReLU) giving attribute logits; with ``hidden = 0``
    a linear (multinomial logistic) ``h_w``: ``D -> C``.

    A linear ``h_w`` is the post-hoc logistic-regression attacker's own model class (ours: on ML-100K the
    attribute's signal in the embeddings is weak and mostly linear, an attacker's LR AUC 0.54-0.65; ``D + 1`` weights
    per class learn it from a few hundred users, where the MLP fits the round's ~94 users and then drifts).

    Args:
        in_dim: ``D``, the user vector's size. num_classes: ``C`` >= 2. hidden: the hidden width (>= 0; 0 = linear).
        generator: initialisation (Xavier-uniform weights, zero biases).

    Raises:
        ValueError: fewer than 2 classes or a negative ``hidden``.
    """

    stochastic = False

    def __init__(self, in_dim: int, num_classes: int, hidden: int, *, generator: torch.Generator) -> None:
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"an attribute adversary needs >= 2 classes, got {num_classes}")
        self.in_dim, self.num_classes = int(in_dim), int(num_classes)
        self.hidden = _hidden_layer(in_dim, hidden)
        self.head = new_linear(hidden or in_dim, num_classes)
        for layer in (self.hidden, self.head):
            if layer is not None:
                init_linear(layer, generator)
        self.generator: torch.Generator | None = None

    @property
    def last_layer(self) -> nn.Linear:
        """The output layer, whose bias gradient is ``p - onehot(a)`` under cross-entropy (what iDLG reads)."""
        return self.head

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        """``(B, D)`` user vectors -> ``(B, C)`` logits (the training forward)."""
        return self.head(u if self.hidden is None else F.relu(self.hidden(u)))

    def predict_logits(self, u: torch.Tensor) -> torch.Tensor:
        """Deterministic logits (``(B, C)``), used by the SUT and by attackers."""
        return self.forward(u)

    def regulariser(self) -> torch.Tensor:
        """Extra loss of the last training forward (none for the plain adversary)."""
        return self.head.bias.new_zeros(())


class DSVAEAdversary(nn.Module):
    """FedAU²'s dual-stochastic variational adversary (our design; the paper gives no code).

    Forward (training), for a user vector ``e``:

    1. Encoder ``e -> ReLU(W1 e + b1) -> (mu, log sigma²)`` (latent size ``latent``).
    2. **Randomness 1, the latent:** ``z = mu + sigma * xi``, ``xi ~ N(0, I)`` drawn on the client
       (reparameterisation, Kingma & Welling 2014, Eq. 10). The server never learns ``xi``, so it cannot reproduce the
       prediction ``p = softmax(W2 z + b2)``, the first part of DLG's label estimate.
    3. **Randomness 2, the last layer's gradient:** the head's weight and bias pass through :func:`noisy_gradient`
       with a fresh ``N(0, noise² I)`` draw per step, independent of ``xi``. Under cross-entropy the bias gradient is
       ``p - onehot(a)``: its only negative entry is the label, which is exactly what iDLG reads (Zhao et al. 2020) and
       what DLG's gradient matching converges to. Adding zero-mean noise of std ``noise`` (``dsvae-gradient-noise``,
       default 1, the scale of ``|p - onehot(a)| <= 1``) blurs that sign pattern on every client, while the server's
       average over ~``m`` clients keeps the true direction with noise shrunk by ``sqrt(m)``. The masking is partial
       and its strength is set by ``noise``: after one SGD step, iDLG on a binary attribute is right with probability
       ``Phi(sqrt(2) * p_o / noise)`` (``p_o`` the predicted probability of the other class), about 0.72 at
       ``noise = 1`` and ``p_o = 0.5`` (measured 0.68 over 200 trials), 0.52 at ``noise = 10``; over ``K`` local
       steps the label's share grows like ``K`` and the noise like ``sqrt(K)`` (tests/test_attacks.py).
    4. ``regulariser()`` is the KL term ``KL(N(mu, sigma²) || N(0, I))`` (Kingma & Welling 2014, Appendix B),
       weighted by ``dsvae-kl-weight`` in the loss.

    Why gradient noise rather than a noisy forward (ours): any forward perturbation of the logits still gives a bias
    gradient ``p~ - onehot(a)`` whose sign pattern names the label; only a perturbation of the last layer's gradient
    itself masks the "label preference" term. There is no decoder: reconstructing the user embedding is not the
    adversary's task, so the encoder + classifier is a variational information bottleneck (Alemi et al. 2017).

    ``predict_logits`` uses ``z = mu`` (deterministic), for the SUT and for attackers.
    """

    stochastic = True

    def __init__(
        self,
        in_dim: int,
        num_classes: int,
        hidden: int,
        latent: int,
        *,
        gradient_noise: float,
        generator: torch.Generator,
    ) -> None:
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"an attribute adversary needs >= 2 classes, got {num_classes}")
        if not math.isfinite(gradient_noise) or gradient_noise < 0:
            raise ValueError(f"DSVAEAdversary: gradient_noise must be a finite number >= 0, got {gradient_noise!r}")
        self.in_dim, self.num_classes, self.latent = int(in_dim), int(num_classes), int(latent)
        self.gradient_noise = float(gradient_noise)
        self.hidden = _hidden_layer(in_dim, hidden)  # None with hidden = 0: a linear encoder D -> 2 * latent
        self.encoder = new_linear(hidden or in_dim, 2 * latent)
        self.head = new_linear(latent, num_classes)
        for layer in (self.hidden, self.encoder, self.head):
            if layer is not None:
                init_linear(layer, generator)
        self.generator: torch.Generator | None = None
        """The client's seeded CPU generator for ``xi`` and the gradient noise (set by the trainer; required)."""
        self._kl: torch.Tensor | None = None

    @property
    def last_layer(self) -> nn.Linear:
        return self.head

    def _encode(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu, logvar = self.encoder(u if self.hidden is None else F.relu(self.hidden(u))).chunk(2, dim=-1)
        return mu, logvar.clamp(-10.0, 10.0)

    def draw(
        self,
        generator: torch.Generator | None,
        rows: int,
        *,
        head_noise: bool,
        noise_generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One training forward's randomness, in the order :meth:`forward` draws it: ``xi`` ``(rows, latent)`` from
        ``generator`` (randomness 1), then, if ``head_noise``, the head weight's ``(C, latent)`` and bias's ``(C,)``
        gradient perturbations, already scaled by ``gradient_noise`` (randomness 2; else ``None``), from
        ``noise_generator`` (``dsvae-noise-stream``'s stream), or from ``generator`` after ``xi`` when it is ``None``.

        Raises:
            RuntimeError: ``generator`` is ``None`` (the client must seed its randomness).
        """
        if generator is None:
            raise RuntimeError("DSVAEAdversary.generator is not set: the client must seed its randomness")
        device = self.head.weight.device
        xi = torch.randn((rows, self.latent), generator=generator).to(device)
        if not head_noise:
            return xi, None, None
        source = generator if noise_generator is None else noise_generator
        weight = self.gradient_noise * torch.randn(self.head.weight.shape, generator=source).to(device)
        bias = self.gradient_noise * torch.randn(self.head.bias.shape, generator=source).to(device)
        return xi, weight, bias

    def forward(
        self, u: torch.Tensor, draws: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None
    ) -> torch.Tensor:
        """``(B, D)`` -> ``(B, C)`` logits with a sampled latent and a noisy last-layer gradient (the training forward).

        ``draws``: this forward's randomness as :meth:`draw` returns it (``xi`` ``(B, latent)``, head perturbations or
        ``None``); by default drawn here from :attr:`generator` (a frozen head, ``adversary-training = "server"``'s
        local copy, gets no perturbation). :func:`~fedrec_flwr.adversary.upload.mean_adversary_gradient` passes
        several users' ``xi`` and the mean of their perturbations."""
        mu, logvar = self._encode(u)
        if draws is None:
            draws = self.draw(
                self.generator, mu.shape[0], head_noise=self.gradient_noise > 0 and self.head.weight.requires_grad
            )
        xi, weight_noise, bias_noise = draws
        z = mu + torch.exp(0.5 * logvar) * xi
        self._kl = 0.5 * (mu.pow(2) + logvar.exp() - 1.0 - logvar).sum(dim=-1).mean()
        weight, bias = self.head.weight, self.head.bias
        if weight_noise is not None:
            weight = noisy_gradient(weight, weight_noise)
            bias = noisy_gradient(bias, bias_noise)
        return F.linear(z, weight, bias)

    def predict_logits(self, u: torch.Tensor) -> torch.Tensor:
        """Deterministic logits from the posterior mean ``z = mu``."""
        mu, _ = self._encode(u)
        return self.head(mu)

    def regulariser(self) -> torch.Tensor:
        """The KL term of the last training forward (0 before any)."""
        return self._kl if self._kl is not None else self.head.bias.new_zeros(())


def build_adversary(
    kind: str,
    in_dim: int,
    num_classes: int,
    *,
    hidden: int,
    latent: int,
    gradient_noise: float,
    generator: torch.Generator,
) -> nn.Module:
    """``"mlp"`` -> :class:`AttributeAdversary`, ``"dsvae"`` -> :class:`DSVAEAdversary` (``hidden = 0``: no hidden
    layer, ``adversary-hidden``).

    Raises:
        ValueError: unknown kind.
    """
    if kind == "mlp":
        return AttributeAdversary(in_dim, num_classes, hidden, generator=generator)
    if kind == "dsvae":
        return DSVAEAdversary(in_dim, num_classes, hidden, latent, gradient_noise=gradient_noise, generator=generator)
    raise ValueError(f"unknown adversary {kind!r}; use 'mlp' or 'dsvae'")


def adversary_of(model: RecModel) -> nn.Module | None:
    """The model's attached adversary, or ``None``."""
    return getattr(model, ADVERSARY_MODULE, None) if ADVERSARY_MODULE in model._shared_names else None
