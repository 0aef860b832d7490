"""Adversarial attribute unlearning (FedAU²): gradient reversal, the attribute adversary ``h_w``, DSVAE, the SUT.

Source: Li et al., "FedAU²: Attribute Unlearning for User-Level Federated Recommender Systems with Adaptive and
Robust Adversarial Training" (arXiv:2511.22872). No public code exists; where the paper is silent the choice is ours
and is marked "(ours)" in the modules.

One local step of a user ``u`` with protected attribute ``a`` (class index) minimises

    L = L_rec(u, items) + CE(h_w(GRL_eps_u(e_u)), a) [+ beta * KL(q(z | e_u) || N(0, I)) for DSVAE]

over the user embedding ``e_u`` (private), the item embeddings and score function (shared) and the adversary ``h_w``
(shared: aggregated by the server like the score function). The gradient reversal layer (Ganin & Lempitsky 2015,
"Unsupervised Domain Adaptation by Backpropagation", Sec. 3.2) is the identity forward and multiplies the gradient by
``-eps_u`` backward, so ``h_w`` learns to predict ``a`` while ``e_u`` moves to defeat it.

* :mod:`.grl`: the gradient reversal layer and the fixed gradient noise (identity-forward autograd functions).
* :mod:`.models`: ``h_w`` (:class:`AttributeAdversary`, :class:`DSVAEAdversary`, :func:`build_adversary`) and the
  user vector it reads (:func:`user_vector`).
* :mod:`.prior`: the class prior (``adversary-class-prior``) and the logit-adjusted cross-entropy.
* :mod:`.term`: the Selective Unlearning Trigger (:func:`sut_strength`), the adversarial loss term on the embedding
  (:class:`AdversarialTerm`) and its trainer.
* :mod:`.upload`: the gradient a client uploads for the server's step of ``h_w`` (:func:`adversary_gradient`,
  :func:`mean_adversary_gradient`), DSVAE's noise on it.
* :mod:`.diagnostics`: how the global ``h_w`` sees every user, per round of a simulation (evaluation only).
* :mod:`.adaptive`: an adaptive GRL weight: summable per-user statistics of ``h_w`` and a controller that sets
  ``eps`` each round from their sum over the round's users (:class:`AdaptiveEpsilon`; ``adversary-weight-rule``).
* :mod:`.secure`: how a node's round vector of ``h_w`` (gradient sums, weight, statistics) reaches the server, in
  the clear or only as a SecAgg+ sum over the round's nodes (``secure-aggregation``).
"""

from fedrec_flwr.adversary.adaptive import AdaptiveEpsilon, AdaptiveEpsilonConfig, adversary_statistics
from fedrec_flwr.adversary.diagnostics import DIAGNOSTICS_FILE, DiagnosticsHook, adversary_diagnostics
from fedrec_flwr.adversary.grl import grad_reverse, noisy_gradient
from fedrec_flwr.adversary.models import (
    ADVERSARY_MODULE,
    AttributeAdversary,
    DSVAEAdversary,
    adversary_of,
    build_adversary,
    user_vector,
    user_vector_dim,
    user_vectors,
)
from fedrec_flwr.adversary.prior import adjusted_ce, class_prior_text, parse_class_prior
from fedrec_flwr.adversary.term import (
    EMBEDDING_OPTIMIZERS,
    OBJECTIVES,
    AdversarialTerm,
    AdversarialTrainer,
    entropy_pull,
    sut_strength,
)
from fedrec_flwr.adversary.upload import (
    NOISE_PLACEMENTS,
    TRAININGS,
    adversary_gradient,
    mean_adversary_gradient,
)

__all__ = [
    "ADVERSARY_MODULE",
    "DIAGNOSTICS_FILE",
    "EMBEDDING_OPTIMIZERS",
    "NOISE_PLACEMENTS",
    "OBJECTIVES",
    "TRAININGS",
    "AdaptiveEpsilon",
    "AdaptiveEpsilonConfig",
    "AdversarialTerm",
    "AdversarialTrainer",
    "AttributeAdversary",
    "DSVAEAdversary",
    "DiagnosticsHook",
    "adversary_diagnostics",
    "adversary_gradient",
    "adversary_statistics",
    "adversary_of",
    "build_adversary",
    "class_prior_text",
    "adjusted_ce",
    "entropy_pull",
    "grad_reverse",
    "mean_adversary_gradient",
    "noisy_gradient",
    "parse_class_prior",
    "sut_strength",
    "user_vector",
    "user_vector_dim",
    "user_vectors",
]
