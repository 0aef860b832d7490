"""The PFedRec model: a shared item embedding and a private, per-user score function; no user embedding.

Zhang, Long, Zhou, Luo, Jiang, Yang, Qin (2023), "Dual Personalization on Federated Recommendation", IJCAI
(PFedRec), Sec. 3: the score of item i for the client's user is ``σ(h(e_i))`` with ``e_i`` the item embedding and
``h`` a per-user score function (one linear layer, Eq. 3 of its code release). The item embedding is aggregated by the
server and fine-tuned locally into the user's personalised view; the score function never leaves the client.
"""

from __future__ import annotations

import torch

from fedrec_flwr.models.base import RecModel, _init_on_cpu, init_embedding, init_linear, new_embedding, new_linear


class PFedRecModel(RecModel):
    """``logit(u, i) = w · e_i + b``: the user is implicit (each client holds its own ``w, b``).

    Modules (state keys; d = ``embedding_dim``):
        private: ``score`` = ``Linear(d, 1)`` (``score.weight`` ``(1, d)``, ``score.bias`` ``(1,)``)
        shared:  ``item_embedding`` (``item_embedding.weight`` ``(num_items, d)``; an item table)

    Every user starts from the same score function (PFedRec's clients copy the server's initial model), so
    :meth:`reset_private` restores the seeded initial value rather than drawing a new one.
    ``num_users`` is accepted for interface compatibility and ignored by :meth:`forward`.
    """

    _private_names = ("score",)
    _shared_names = ("item_embedding",)
    _item_table_names = ("item_embedding",)

    def __init__(self, num_users: int, num_items: int, embedding_dim: int = 32, *, generator: torch.Generator) -> None:
        super().__init__(num_users, num_items, embedding_dim)
        self.item_embedding = new_embedding(self.num_items, self.embedding_dim)
        self.score = new_linear(self.embedding_dim, 1)
        self._check_partition()
        self._init_shared(generator)
        _init_on_cpu(self.score, generator, init_linear)
        self._initial_score = {k: v.detach().clone() for k, v in self.score.state_dict().items()}

    def _init_shared(self, generator: torch.Generator) -> None:
        _init_on_cpu(self.item_embedding, generator, init_embedding)

    @torch.no_grad()
    def reset_private(self, generator: torch.Generator) -> None:
        """Restore the initial score function (the generator is not used: every user starts from the same one)."""
        for key, value in self._initial_score.items():
            getattr(self.score, key).copy_(value.to(getattr(self.score, key).device))

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """Logits ``(B,)`` float32 for item indices ``items`` (B,) int64; ``users`` is ignored."""
        return self.score(self.item_embedding(items)).squeeze(-1)
