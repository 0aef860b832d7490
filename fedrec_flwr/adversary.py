"""Adversarial attribute unlearning (FedAU²): gradient reversal, the attribute adversary ``h_w``, DSVAE, the SUT.

Source: Li et al., "FedAU²: Attribute Unlearning for User-Level Federated Recommender Systems with Adaptive and
Robust Adversarial Training" (arXiv:2511.22872). No public code exists; where the paper is silent the choice is ours
and is marked "(ours)" below.

One local step of a user ``u`` with protected attribute ``a`` (class index) minimises

    L = L_rec(u, items) + CE(h_w(GRL_eps_u(e_u)), a) [+ beta * KL(q(z | e_u) || N(0, I)) for DSVAE]

over the user embedding ``e_u`` (private), the item embeddings and score function (shared) and the adversary ``h_w``
(shared: aggregated by the server like the score function). The gradient reversal layer (Ganin & Lempitsky 2015,
"Unsupervised Domain Adaptation by Backpropagation", Sec. 3.2) is the identity forward and multiplies the gradient by
``-eps_u`` backward, so ``h_w`` learns to predict ``a`` while ``e_u`` moves to defeat it.

* **Selective Unlearning Trigger (SUT, the paper's binary variant):** ``eps_u = eps`` when ``h_w`` currently predicts
  the user's attribute correctly, else 0; decided before each step with ``h_w``'s deterministic prediction (for DSVAE,
  the posterior mean; ours). ``trigger = "always"`` gives plain adversarial training with a constant ``eps``.
* **DSVAE (ours in detail, see :class:`DSVAEAdversary`):** a variational adversary with two independent sources of
  randomness, against gradient label leakage (DLG / iDLG) by an honest-but-curious server.

The user embedding fed to ``h_w`` is the concatenation of the model's user-embedding rows (NCF: GMF and MLP
embeddings, ``2d``; MF: ``d``), :func:`user_vector`.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedrec_flwr.attributes import published_class_prior
from fedrec_flwr.local.training import LocalTrainConfig, LocalTrainer
from fedrec_flwr.models.base import RecModel, init_linear, new_linear

log = logging.getLogger(__name__)

ADVERSARY_MODULE = "adversary"
TRAININGS = ("server", "per-client")
"""How ``h_w`` is trained (``adversary-training``): ``"server"``, the round's global ``h_w`` frozen on every client and
stepped by the server on the clients' averaged gradients (:func:`adversary_gradient`,
:class:`fedrec_flwr.strategies.adversary.AdversaryServerStep`); ``"per-client"``, FedAU² as first implemented: each client trains
its local copy of ``h_w`` on its own label with its local optimizer, and the strategy averages the copies (FedAvg)."""
EMBEDDING_OPTIMIZERS = ("local", "sgd")
"""Who applies the adversarial term's gradient to the user embedding (``adversary-embedding-optimizer``): ``"local"``,
the local trainer's optimizer (Adam by default: it normalises the reversed gradient away, so ``eps`` only decides which
coordinates move), or ``"sgd"``: a plain SGD step of size ``learning-rate`` on the reversed gradient (or, with
``adversary-objective = "entropy"``, on the pull toward ``h_w``'s uniform prediction), which keeps its size (``eps``
then scales the step; the pull's step shrinks to 0 as the embedding reaches the uniform point, where Adam's does not)."""
NOISE_PLACEMENTS = ("head", "all")
"""Which parameters' uploaded gradients get DSVAE's label-masking noise (``dsvae-noise-placement``, server training):
``"head"``, the last layer only (as first built: iDLG reads the head's bias gradient ``p - onehot(a)``), or ``"all"``
(ours): every parameter of ``h_w``, since the encoder's gradient carries ``W_head^T (p - onehot(a))``
unperturbed and DLG's gradient matching reads the label from it (measured: DLG 1.00 with ``"head"``)."""
OBJECTIVES = ("reverse", "entropy")
"""What the embedding's adversarial gradient does (:class:`AdversarialTerm`): FedAU²'s gradient reversal, or (ours)
the maximum-entropy control."""
"""Name of the adversary's module in the model (its shared-state keys start with ``"adversary."``)."""


# ---------------------------------------------------------------------------------------------------- GRL
class _GradientReversal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, strength: torch.Tensor) -> torch.Tensor:  # noqa: D401
        ctx.save_for_backward(strength)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (strength,) = ctx.saved_tensors
        return -strength * grad, None


def grad_reverse(x: torch.Tensor, strength: float | torch.Tensor) -> torch.Tensor:
    """Gradient reversal layer: returns ``x`` unchanged; backward multiplies the incoming gradient by ``-strength``.

    Ganin & Lempitsky (2015), Eq. 11-12. ``strength`` is a float or a tensor broadcastable to ``x`` (e.g. ``(B, 1)``
    per-example strengths, as the SUT gives); no gradient flows into ``strength``. Parameters *after* the layer
    (the adversary's) get their ordinary gradient; only what flows back into ``x`` is reversed.
    """
    strength = torch.as_tensor(strength, dtype=x.dtype, device=x.device)
    return _GradientReversal.apply(x, strength)


class _NoisyGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:  # noqa: D401
        ctx.save_for_backward(noise)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (noise,) = ctx.saved_tensors
        return grad + noise, None


def noisy_gradient(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Identity forward; backward adds the fixed tensor ``noise`` (shape of ``x``) to the gradient of ``x``."""
    return _NoisyGradient.apply(x, noise)


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


def entropy_pull(adversary: nn.Module, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The entropy objective's pull on ``n`` users' vectors ``u`` ``(n, D)``: ``(pull (n, D), logits (n, C))``, row
    ``k`` of ``pull`` the gradient of ``H_x(uniform, softmax(h_w(u_k)))`` (the mean over classes of ``-log softmax``
    of ``h_w``'s deterministic logits; Roy & Boddeti 2019, Eq. 4) with respect to ``u_k`` alone (``h_w`` frozen in
    it; one autograd pass over the sum of the rows, each depending on its own row only)."""
    leaf = u.detach().requires_grad_(True)
    with torch.enable_grad():
        logits = adversary.predict_logits(leaf)
        (pull,) = torch.autograd.grad(-F.log_softmax(logits, dim=-1).mean(dim=-1).sum(), leaf)
    return pull, logits.detach()


def user_vector_dim(model: RecModel) -> int:
    """``D`` of :func:`user_vector`."""
    return sum(t.embedding_dim for t in model.user_embedding_modules().values())


# ---------------------------------------------------------------------------------------------------- adversaries
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
        local copy, gets no perturbation). :func:`mean_adversary_gradient` passes several users' ``xi`` and the mean
        of their perturbations."""
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


# ---------------------------------------------------------------------------------------------------- local training
def sut_strength(adversary: nn.Module, u: torch.Tensor, label: int, epsilon: float, trigger: str) -> float:
    """The GRL strength ``eps_u`` of one step: ``epsilon`` when ``trigger = "always"``; with ``"sut"``, ``epsilon``
    if the adversary's deterministic prediction for ``u`` (``(1, D)``) is ``label``, else 0 (FedAU²'s binary SUT)."""
    if trigger == "always":
        return float(epsilon)
    if trigger != "sut":
        raise ValueError(f"adversary trigger must be 'sut' or 'always', got {trigger!r}")
    with torch.no_grad():
        correct = int(adversary.predict_logits(u.detach()).argmax(dim=-1)[0]) == int(label)
    return float(epsilon) if correct else 0.0


def _cross_entropy(logits: torch.Tensor, target: torch.Tensor, log_prior: torch.Tensor | None) -> torch.Tensor:
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


class AdversarialTerm:
    """FedAU²'s adversarial loss term for one user, added to every mini-batch of any trainer
    (:attr:`fedrec_flwr.local.training.LocalTrainer.loss_terms`; with SAM, to every chunk of every loss evaluation).

    Calling it returns, for the user's current embedding ``e_u`` and ``eps_u`` decided afresh by :func:`sut_strength`:

    * ``objective = "reverse"`` (FedAU², module docstring): ``CE(h_w(GRL_eps_u(e_u)), a) + kl_weight * KL``. The
      embedding climbs the adversary's loss on its *own* label, so the direction it moves in depends on the label.
    * ``objective = "entropy"`` (ours, not FedAU²; the maximum-entropy adversarial objective of Roy & Boddeti 2019,
      "Mitigating Information Leakage in Image Representations: A Maximum Entropy Approach", Eq. 4):
      ``CE(h_w(e_u.detach()), a) + kl_weight * KL + eps_u * H_x(uniform, softmax(h_w(e_u)))``, where the last term's
      gradient reaches only ``e_u`` (``h_w`` frozen in it): the embedding moves toward where ``h_w`` predicts every
      class equally, a target that is the same for every label. Measured on MovieLens-100K (experiments/fedau2), the
      label-dependent push of ``"reverse"`` writes the attribute into the embeddings; this objective is the control.

    Args:
        model: the one-user model with an attached adversary (``model.adversary``).
        label: the user's protected attribute class (private; never leaves the client).
        epsilon: GRL strength ``eps`` (>= 0). trigger: ``"sut"`` or ``"always"``.
        kl_weight: weight of the adversary's regulariser (DSVAE's KL).
        generator: CPU generator for the adversary's randomness (DSVAE).
        objective: ``"reverse"`` (default) or ``"entropy"``.
        frozen: ``adversary-training = "server"``: ``h_w`` is the round's global copy and is never changed by the
            term (its parameters get no gradient; the term only moves the embedding); the SUT and the GRL therefore
            read the same ``h_w`` on every step. ``False`` (``"per-client"``, as first implemented): the term also
            trains the local copy of ``h_w`` on the user's own label. A frozen term's value is 0 (only its
            gradient counts), so the ``train-loss`` a client reports holds no cross-entropy on its label.
        embedding_step: 0 (``adversary-embedding-optimizer = "local"``): the term is a loss the trainer's optimizer
            steps; ``> 0`` (``"sgd"``, needs ``frozen``): at each call the term takes the plain SGD step
            ``e_u <- e_u + embedding_step * eps_u * dCE(h_w(e_u), a)/de_u`` itself (the GRL's reversed gradient at its
            full size; ours: an operator split, the recommendation step follows with the trainer's optimizer) and
            returns 0. With ``objective = "entropy"`` the step is the pull's,
            ``e_u <- e_u - embedding_step * eps_u * dH_x(uniform, softmax(h_w(e_u)))/de_u`` (ours: Adam
            moves each coordinate by about its rate whatever the pull's size, about 0.06 per local round on
            MovieLens-100K against an embedding spread of about 0.1, so the pull can overshoot the uniform point;
            SGD's step shrinks to 0 there).
        log_prior: ``(C,)`` log class prior for the logit-adjusted loss (:func:`_cross_entropy`), or ``None``.

    Attributes:
        steps / triggered: how many times the term was evaluated, and how many of those had ``eps_u > 0`` (local
            diagnostics; never sent).

    Raises:
        ValueError: the model has no adversary, ``label`` is outside its classes, or an unknown trigger or objective.
    """

    def __init__(
        self,
        model: RecModel,
        *,
        label: int,
        epsilon: float,
        trigger: str,
        kl_weight: float,
        generator: torch.Generator,
        objective: str = "reverse",
        frozen: bool = False,
        embedding_step: float = 0.0,
        log_prior: torch.Tensor | None = None,
    ) -> None:
        adversary = adversary_of(model)
        if adversary is None:
            raise ValueError("AdversarialTerm: the model has no adversary module")
        if not 0 <= int(label) < adversary.num_classes:
            raise ValueError(f"AdversarialTerm: label {label} outside [0, {adversary.num_classes})")
        if trigger not in ("sut", "always"):
            raise ValueError(f"adversary trigger must be 'sut' or 'always', got {trigger!r}")
        if objective not in OBJECTIVES:
            raise ValueError(f"adversary objective must be one of {OBJECTIVES}, got {objective!r}")
        self.objective = objective
        self.model = model
        self.adversary = adversary
        self.adversary.generator = generator
        self.label = int(label)
        self.epsilon, self.trigger, self.kl_weight = float(epsilon), str(trigger), float(kl_weight)
        self._target = torch.tensor([self.label], dtype=torch.long, device=adversary.head.weight.device)
        self.steps = self.triggered = 0
        if embedding_step < 0 or not math.isfinite(embedding_step):
            raise ValueError(f"AdversarialTerm: embedding_step must be a finite number >= 0, got {embedding_step!r}")
        if embedding_step > 0 and not frozen:
            raise ValueError(
                "AdversarialTerm: an SGD embedding step needs the frozen global adversary "
                "(adversary-training = 'server')"
            )
        self.frozen, self.embedding_step = bool(frozen), float(embedding_step)
        self.log_prior = None if log_prior is None else log_prior.to(adversary.head.weight.device)

    def _frozen_logits(self, u: torch.Tensor) -> torch.Tensor:
        """``h_w(u)`` with ``h_w``'s parameters detached: gradient reaches ``u`` only."""
        params = {name: p.detach() for name, p in self.adversary.named_parameters()}
        return torch.func.functional_call(self.adversary, params, (u,))

    def _sgd_step(self, u: torch.Tensor, strength: float) -> None:
        """``e_u <- e_u + embedding_step * strength * dCE/de_u`` (``"reverse"``) or ``e_u <- e_u - embedding_step *
        strength * dH_x(uniform, softmax(h_w(e_u)))/de_u`` (``"entropy"``) on the model's user rows, in place."""
        leaf = u.detach().requires_grad_(True)
        if self.objective == "entropy":
            grad = -entropy_pull(self.adversary, u)[0]  # the step below adds: descend H_x
        else:
            (grad,) = torch.autograd.grad(_cross_entropy(self._frozen_logits(leaf), self._target, self.log_prior), leaf)
        step = self.embedding_step * strength * grad[0]
        with torch.no_grad():
            start = 0
            for table in self.model.user_embedding_modules().values():
                width = table.embedding_dim
                table.weight[0].add_(step[start : start + width])
                start += width

    def __call__(self) -> torch.Tensor:
        u = user_vector(self.model)
        strength = sut_strength(self.adversary, u, self.label, self.epsilon, self.trigger)
        self.steps += 1
        self.triggered += int(strength > 0)
        if self.frozen and self.objective == "reverse":
            if self.embedding_step > 0:
                if strength > 0:
                    self._sgd_step(u, strength)
                return u.new_zeros(())
            ce = _cross_entropy(self._frozen_logits(grad_reverse(u, strength)), self._target, self.log_prior)
            return ce - ce.detach()  # its gradient only: the reported train loss carries no label-dependent CE
        if self.objective == "reverse":
            logits = self.adversary(grad_reverse(u, strength))
            return _cross_entropy(logits, self._target, self.log_prior) + self.kl_weight * self.adversary.regulariser()
        if self.frozen and self.embedding_step > 0:  # the pull's own SGD step (entropy); nothing for the optimizer
            if strength > 0:
                self._sgd_step(u, strength)
            return u.new_zeros(())
        if self.frozen:  # h_w is trained by the server: only the embedding's pull below
            loss = u.new_zeros(())
        else:
            logits = self.adversary(u.detach())
            loss = _cross_entropy(logits, self._target, self.log_prior) + self.kl_weight * self.adversary.regulariser()
        if strength > 0:
            pull = entropy_pull(self.adversary, u)[0]
            loss = loss + strength * (u * pull).sum()  # gradient strength * pull on e_u only
        return loss


class AdversarialTrainer(LocalTrainer):
    """A :class:`~fedrec_flwr.local.training.LocalTrainer` with FedAU²'s :class:`AdversarialTerm` on every mini-batch
    (arguments as there). ``steps`` / ``triggered`` are the term's counters."""

    def __init__(
        self,
        model: RecModel,
        cfg: LocalTrainConfig,
        *,
        label: int,
        epsilon: float,
        trigger: str,
        kl_weight: float,
        generator: torch.Generator,
    ) -> None:
        super().__init__(model, cfg)
        self.term = AdversarialTerm(
            self.model, label=label, epsilon=epsilon, trigger=trigger, kl_weight=kl_weight, generator=generator
        )
        self.loss_terms.append(self.term)

    @property
    def steps(self) -> int:
        return self.term.steps

    @property
    def triggered(self) -> int:
        return self.term.triggered


# ---------------------------------------------------------------------------------------------------- server training
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
        loss = _cross_entropy(logits, labels, log_prior) + kl_weight * adversary.regulariser()
        extra = {key: mean_of([e[key] for e in encoder]) for key in encoder[0]}
    else:
        loss = _cross_entropy(adversary(vectors.detach()), labels, log_prior)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    out = {
        f"{ADVERSARY_MODULE}.{name}": torch.zeros_like(p) if g is None else g.detach()
        for name, p, g in zip(names, params, grads)
    }
    for key, noise in extra.items():
        out[key] = out[key] + noise
    return out


# ---------------------------------------------------------------------------------------------------- diagnostics
DIAGNOSTICS_FILE = "adversary-diagnostics.csv"


@torch.no_grad()
def adversary_diagnostics(adversary: nn.Module, embeddings: torch.Tensor, labels) -> dict[str, float]:
    """How the (global) adversary ``h_w`` sees every user, for the per-round diagnostics (evaluation only: it needs
    the true labels, which never leave a client; :class:`DiagnosticsHook`).

    Args:
        adversary: ``h_w`` (deterministic prediction, ``predict_logits``).
        embeddings: ``(N, D)`` user vectors (:func:`user_vector` layout). labels: ``(N,)`` class indices.

    Returns:
        ``users``; per class ``c``: ``predicted-share-c`` (share of all users ``h_w`` assigns to ``c``) and
        ``trigger-rate-c`` (share of class-``c`` users it predicts correctly: where the binary SUT fires);
        ``balanced-accuracy`` (mean of the per-class trigger rates over classes present); ``auc`` (``h_w``'s own
        ROC AUC, one-vs-rest macro for more than two classes; NaN with one class present).
    """
    from sklearn.metrics import roc_auc_score

    labels = torch.as_tensor(labels, dtype=torch.long)
    logits = adversary.predict_logits(torch.as_tensor(embeddings, dtype=torch.float32))
    predicted = logits.argmax(dim=-1)
    num_classes = logits.shape[1]
    out: dict[str, float] = {"users": float(len(labels))}
    rates = []
    for c in range(num_classes):
        out[f"predicted-share-{c}"] = float((predicted == c).float().mean()) if len(labels) else float("nan")
        members = labels == c
        rate = float((predicted[members] == c).float().mean()) if members.any() else float("nan")
        out[f"trigger-rate-{c}"] = rate
        if members.any():
            rates.append(rate)
    out["balanced-accuracy"] = float(np.mean(rates)) if rates else float("nan")
    present = np.unique(labels.numpy())
    if len(present) < 2:
        out["auc"] = float("nan")
    elif num_classes == 2:
        out["auc"] = float(roc_auc_score(labels.numpy(), logits[:, 1].numpy() - logits[:, 0].numpy()))
    else:
        probs = torch.softmax(logits, dim=-1).numpy()
        out["auc"] = (
            float(
                roc_auc_score(
                    labels.numpy(),
                    probs[:, present] / probs[:, present].sum(1, keepdims=True),
                    multi_class="ovr",
                    labels=present,
                )
            )
            if len(present) > 2
            else float("nan")
        )
    return out


class DiagnosticsHook:
    """An ``on_round`` hook of an in-process simulation (:func:`fedrec_flwr.serial.run_serial`) that appends
    :func:`adversary_diagnostics` of the round's global ``h_w`` over every user trained so far to
    ``adversary-diagnostics.csv`` in the results folder (column ``round`` first), then calls ``then``.

    Evaluation only: the users' embeddings are read from the simulated nodes' private state and their labels from
    the split (as :func:`fedrec_flwr.attacks.collect_user_embeddings`); nothing travels in a message, and a
    deployment has no such hook.
    """

    def __init__(self, runtime, then=None) -> None:
        self.runtime, self.then = runtime, then
        cfg = runtime.config
        self.adversary = build_adversary(
            cfg.adversary,
            user_vector_dim(runtime.model),
            runtime.protected.num_classes,
            hidden=cfg.adversary_hidden,
            latent=cfg.dsvae_latent_dim,
            gradient_noise=0.0,
            generator=torch.Generator().manual_seed(0),
        )
        self.rows: list[dict] = []

    def __call__(self, view) -> None:
        import pandas as pd

        from fedrec_flwr.attacks import collect_user_embeddings
        from fedrec_flwr.io import atomic_write_text

        prefix = ADVERSARY_MODULE + "."
        with torch.no_grad():
            for name, param in self.adversary.named_parameters():
                param.copy_(torch.as_tensor(view.arrays[prefix + name].numpy()))
        runtime = self.runtime
        states = [context.state for context in view.grid.contexts.values()]
        x, present = collect_user_embeddings(states, runtime.layout.private_keys, runtime.split.num_users)
        if present.any():
            row = {
                "round": view.server_round,
                **adversary_diagnostics(self.adversary, torch.as_tensor(x[present]), runtime.protected.labels[present]),
            }
            self.rows.append(row)
            atomic_write_text(
                Path(view.folder) / DIAGNOSTICS_FILE, pd.DataFrame(self.rows).to_csv(index=False, float_format="%.5f")
            )
        if self.then is not None:
            self.then(view)
