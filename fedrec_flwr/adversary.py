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

import math

import torch
import torch.nn.functional as F
from torch import nn

from .models.base import RecModel, init_linear, new_linear
from .training import LocalTrainConfig, LocalTrainer

ADVERSARY_MODULE = "adversary"
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


def user_vector_dim(model: RecModel) -> int:
    """``D`` of :func:`user_vector`."""
    return sum(t.embedding_dim for t in model.user_embedding_modules().values())


# ---------------------------------------------------------------------------------------------------- adversaries
class AttributeAdversary(nn.Module):
    """The plain adversary ``h_w``: an MLP ``D -> hidden -> C`` (ReLU) giving attribute logits.

    Args:
        in_dim: ``D``, the user vector's size. num_classes: ``C`` >= 2. hidden: the hidden width.
        generator: initialisation (Xavier-uniform weights, zero biases).
    """

    stochastic = False

    def __init__(self, in_dim: int, num_classes: int, hidden: int, *, generator: torch.Generator) -> None:
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"an attribute adversary needs >= 2 classes, got {num_classes}")
        self.in_dim, self.num_classes = int(in_dim), int(num_classes)
        self.hidden = new_linear(in_dim, hidden)
        self.head = new_linear(hidden, num_classes)
        for layer in (self.hidden, self.head):
            init_linear(layer, generator)
        self.generator: torch.Generator | None = None

    @property
    def last_layer(self) -> nn.Linear:
        """The output layer, whose bias gradient is ``p - onehot(a)`` under cross-entropy (what iDLG reads)."""
        return self.head

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        """``(B, D)`` user vectors -> ``(B, C)`` logits (the training forward)."""
        return self.head(F.relu(self.hidden(u)))

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

    def __init__(self, in_dim: int, num_classes: int, hidden: int, latent: int, *, gradient_noise: float,
                 generator: torch.Generator) -> None:
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"an attribute adversary needs >= 2 classes, got {num_classes}")
        if not math.isfinite(gradient_noise) or gradient_noise < 0:
            raise ValueError(f"DSVAEAdversary: gradient_noise must be a finite number >= 0, got {gradient_noise!r}")
        self.in_dim, self.num_classes, self.latent = int(in_dim), int(num_classes), int(latent)
        self.gradient_noise = float(gradient_noise)
        self.hidden = new_linear(in_dim, hidden)
        self.encoder = new_linear(hidden, 2 * latent)
        self.head = new_linear(latent, num_classes)
        for layer in (self.hidden, self.encoder, self.head):
            init_linear(layer, generator)
        self.generator: torch.Generator | None = None
        """The client's seeded CPU generator for ``xi`` and the gradient noise (set by the trainer; required)."""
        self._kl: torch.Tensor | None = None

    @property
    def last_layer(self) -> nn.Linear:
        return self.head

    def _encode(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu, logvar = self.encoder(F.relu(self.hidden(u))).chunk(2, dim=-1)
        return mu, logvar.clamp(-10.0, 10.0)

    def _draw(self, shape) -> torch.Tensor:
        if self.generator is None:
            raise RuntimeError("DSVAEAdversary.generator is not set: the client must seed its randomness")
        return torch.randn(shape, generator=self.generator).to(self.head.weight.device)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        """``(B, D)`` -> ``(B, C)`` logits with a sampled latent and a noisy last-layer gradient (the training forward)."""
        mu, logvar = self._encode(u)
        z = mu + torch.exp(0.5 * logvar) * self._draw(mu.shape)
        self._kl = 0.5 * (mu.pow(2) + logvar.exp() - 1.0 - logvar).sum(dim=-1).mean()
        weight, bias = self.head.weight, self.head.bias
        if self.gradient_noise > 0:
            weight = noisy_gradient(weight, self.gradient_noise * self._draw(weight.shape))
            bias = noisy_gradient(bias, self.gradient_noise * self._draw(bias.shape))
        return F.linear(z, weight, bias)

    def predict_logits(self, u: torch.Tensor) -> torch.Tensor:
        """Deterministic logits from the posterior mean ``z = mu``."""
        mu, _ = self._encode(u)
        return self.head(mu)

    def regulariser(self) -> torch.Tensor:
        """The KL term of the last training forward (0 before any)."""
        return self._kl if self._kl is not None else self.head.bias.new_zeros(())


def build_adversary(kind: str, in_dim: int, num_classes: int, *, hidden: int, latent: int, gradient_noise: float,
                    generator: torch.Generator) -> nn.Module:
    """``"mlp"`` -> :class:`AttributeAdversary`, ``"dsvae"`` -> :class:`DSVAEAdversary`.

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


class AdversarialTerm:
    """FedAU²'s adversarial loss term for one user, added to every mini-batch of any trainer
    (:attr:`fedrec_flwr.training.LocalTrainer.loss_terms`; with SAM, to every chunk of every loss evaluation).

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

    Attributes:
        steps / triggered: how many times the term was evaluated, and how many of those had ``eps_u > 0`` (local
            diagnostics; never sent).

    Raises:
        ValueError: the model has no adversary, ``label`` is outside its classes, or an unknown trigger or objective.
    """

    def __init__(self, model: RecModel, *, label: int, epsilon: float, trigger: str, kl_weight: float,
                 generator: torch.Generator, objective: str = "reverse") -> None:
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

    def __call__(self) -> torch.Tensor:
        u = user_vector(self.model)
        strength = sut_strength(self.adversary, u, self.label, self.epsilon, self.trigger)
        self.steps += 1
        self.triggered += int(strength > 0)
        if self.objective == "reverse":
            logits = self.adversary(grad_reverse(u, strength))
            return F.cross_entropy(logits, self._target) + self.kl_weight * self.adversary.regulariser()
        logits = self.adversary(u.detach())
        loss = F.cross_entropy(logits, self._target) + self.kl_weight * self.adversary.regulariser()
        if strength > 0:
            u_leaf = u.detach().requires_grad_(True)
            uniform_ce = -F.log_softmax(self.adversary.predict_logits(u_leaf), dim=-1).mean()
            (pull,) = torch.autograd.grad(uniform_ce, u_leaf)
            loss = loss + strength * (u * pull.detach()).sum()  # gradient strength * pull on e_u only
        return loss


class AdversarialTrainer(LocalTrainer):
    """A :class:`~fedrec_flwr.training.LocalTrainer` with FedAU²'s :class:`AdversarialTerm` on every mini-batch
    (arguments as there). ``steps`` / ``triggered`` are the term's counters."""

    def __init__(self, model: RecModel, cfg: LocalTrainConfig, *, label: int, epsilon: float, trigger: str,
                 kl_weight: float, generator: torch.Generator) -> None:
        super().__init__(model, cfg)
        self.term = AdversarialTerm(self.model, label=label, epsilon=epsilon, trigger=trigger, kl_weight=kl_weight,
                                    generator=generator)
        self.loss_terms.append(self.term)

    @property
    def steps(self) -> int:
        return self.term.steps

    @property
    def triggered(self) -> int:
        return self.term.triggered
