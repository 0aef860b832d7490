"""FedAU²'s adversarial loss term on a user's embedding (arXiv:2511.22872): the Selective Unlearning Trigger, the
gradient-reversed (or maximum-entropy) term, and a local trainer that adds it to every mini-batch.

One local step of a user ``u`` with protected attribute ``a`` (class index) minimises

    L = L_rec(u, items) + CE(h_w(GRL_eps_u(e_u)), a) [+ beta * KL(q(z | e_u) || N(0, I)) for DSVAE]

over the user embedding ``e_u`` (private), the item embeddings and score function (shared) and, with
``adversary-training = "per-client"``, the adversary ``h_w``. The gradient reversal layer (:func:`grad_reverse`)
is the identity forward and multiplies the gradient by ``-eps_u`` backward, so ``h_w`` learns to predict ``a`` while
``e_u`` moves to defeat it.

**Selective Unlearning Trigger (SUT, the paper's binary variant):** ``eps_u = eps`` when ``h_w`` currently predicts the
user's attribute correctly, else 0; decided before each step with ``h_w``'s deterministic prediction (for DSVAE, the
posterior mean; ours). ``trigger = "always"`` gives plain adversarial training with a constant ``eps``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fedrec_flwr.adversary.grl import grad_reverse
from fedrec_flwr.adversary.models import adversary_of, user_vector
from fedrec_flwr.adversary.prior import adjusted_ce
from fedrec_flwr.local.training import LocalTrainConfig, LocalTrainer
from fedrec_flwr.models.base import RecModel

EMBEDDING_OPTIMIZERS = ("local", "sgd")
"""Who applies the adversarial term's gradient to the user embedding (``adversary-embedding-optimizer``): ``"local"``,
the local trainer's optimizer (Adam by default: it normalises the reversed gradient away, so ``eps`` only decides which
coordinates move), or ``"sgd"``: a plain SGD step of size ``learning-rate`` on the reversed gradient (or, with
``adversary-objective = "entropy"``, on the pull toward ``h_w``'s uniform prediction), which keeps its size (``eps``
then scales the step; the pull's step shrinks to 0 as the embedding reaches the uniform point, where Adam's does not)."""
OBJECTIVES = ("reverse", "entropy")
"""What the embedding's adversarial gradient does (:class:`AdversarialTerm`): FedAU²'s gradient reversal, or (ours)
the maximum-entropy control."""


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
        log_prior: ``(C,)`` log class prior for the logit-adjusted loss
            (:func:`~fedrec_flwr.adversary.prior.adjusted_ce`), or ``None``.

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
            (grad,) = torch.autograd.grad(adjusted_ce(self._frozen_logits(leaf), self._target, self.log_prior), leaf)
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
            ce = adjusted_ce(self._frozen_logits(grad_reverse(u, strength)), self._target, self.log_prior)
            return ce - ce.detach()  # its gradient only: the reported train loss carries no label-dependent CE
        if self.objective == "reverse":
            logits = self.adversary(grad_reverse(u, strength))
            return adjusted_ce(logits, self._target, self.log_prior) + self.kl_weight * self.adversary.regulariser()
        if self.frozen and self.embedding_step > 0:  # the pull's own SGD step (entropy); nothing for the optimizer
            if strength > 0:
                self._sgd_step(u, strength)
            return u.new_zeros(())
        if self.frozen:  # h_w is trained by the server: only the embedding's pull below
            loss = u.new_zeros(())
        else:
            logits = self.adversary(u.detach())
            loss = adjusted_ce(logits, self._target, self.log_prior) + self.kl_weight * self.adversary.regulariser()
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
