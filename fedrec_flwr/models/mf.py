"""Matrix factorisation as used by FedMF.

Chai, Wang, Chen, Yang, "Secure Federated Matrix Factorization" (arXiv:1906.05108; IEEE Intelligent Systems 36(5)):
the score of user u for item i is the dot product p_u · q_i of the user and item latent vectors. FedMF protects the item-gradient
upload with homomorphic encryption; **this implementation has no encryption** (plain model updates), so it is the
FedMF model and training schedule, not its privacy mechanism. There is no bias term: a pure dot product.
"""

from __future__ import annotations

import torch

from fedrec_flwr.models.base import RecModel, _init_on_cpu, init_embedding, new_embedding


class MF(RecModel):
    """Dot-product matrix factorisation: ``logit(u, i) = <p_u, q_i>``.

    Modules (state keys):
        private: ``user_embedding`` (``user_embedding.weight``, ``(num_users, d)`` float32)
        shared:  ``item_embedding`` (``item_embedding.weight``, ``(num_items, d)`` float32; an item table)

    Initialisation: both tables N(0, 0.01²) from the given generator (see :func:`fedrec_flwr.models.build_model`).
    """

    _private_names = ("user_embedding",)
    _shared_names = ("item_embedding",)
    _item_table_names = ("item_embedding",)

    def __init__(self, num_users: int, num_items: int, embedding_dim: int = 32, *, generator: torch.Generator) -> None:
        super().__init__(num_users, num_items, embedding_dim)
        self.user_embedding = new_embedding(self.num_users, self.embedding_dim)
        self.item_embedding = new_embedding(self.num_items, self.embedding_dim)
        self._check_partition()
        self.reset_parameters(generator)

    def _init_shared(self, generator: torch.Generator) -> None:
        _init_on_cpu(self.item_embedding, generator, init_embedding)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """Logits ``(B,)`` float32 = row-wise dot product of user rows ``users`` (B,) and item rows ``items`` (B,)."""
        return (self.user_embedding(users) * self.item_embedding(items)).sum(dim=-1)
