"""Neural collaborative filtering (NeuMF), as FedNCF and FedRecGEL use it.

He, Liao, Zhang, Nie, Hu, Chua (2017), "Neural Collaborative Filtering", WWW, Sec. 3.4 (NeuMF): fuses generalized
matrix factorization (``phi_GMF = p_u^G ⊙ q_i^G``) and a multi-layer perceptron over the concatenated embeddings
(``phi_MLP = a_L(W_L^T(...a_2(W_2^T [p_u^M; q_i^M] + b_2)...) + b_L)``, ReLU activations), then scores
``y = σ(h^T [phi_GMF; phi_MLP])``. We return the pre-sigmoid logit. Federated use as in Perifanis & Efraimidis
(2022), "Federated Neural Collaborative Filtering" (FedNCF): user embeddings stay on the client, everything else is
aggregated.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fedrec_flwr.models.base import RecModel, _init_on_cpu, init_embedding, init_linear, new_embedding, new_linear


class NCF(RecModel):
    """NeuMF = GMF + MLP with separate GMF and MLP embeddings.

    Modules (state keys; d = ``embedding_dim``, m = ``mlp_embedding_dim`` (``d`` when 0), L = ``mlp_layers``):
        private: ``user_embedding_gmf`` (``(num_users, d)``), ``user_embedding_mlp`` (``(num_users, m)``)
        shared:  ``item_embedding_gmf`` (``(num_items, d)``), ``item_embedding_mlp`` (``(num_items, m)``) — item
                 tables; ``mlp`` = ``nn.Sequential(Linear(2m, L[0]), ReLU, Linear(L[0], L[1]), ReLU, ...)`` with keys
                 ``mlp.0.weight``, ``mlp.0.bias``, ``mlp.2.weight``, ...; ``output`` = ``Linear(d + L[-1], 1)``.
        FedRecGEL's public code (``models/fedrecgel.py``, ``factor_num = 32``, ``num_layers = 3``) is d = 32,
        m = 128, L = (128, 64, 32); ours by default d = m = 32, L = (64, 32, 16).

    Initialisation: embeddings N(0, 0.01²) (He et al. 2017, Sec. 4.1), linear layers Xavier-uniform with zero bias,
    all drawn from the given generator. No pre-training of GMF/MLP (the papers' optional step) is done.
    """

    _private_names = ("user_embedding_gmf", "user_embedding_mlp")
    _shared_names = ("item_embedding_gmf", "item_embedding_mlp", "mlp", "output")
    _item_table_names = ("item_embedding_gmf", "item_embedding_mlp")

    def __init__(
        self,
        num_users: int,
        num_items: int,
        embedding_dim: int = 32,
        mlp_layers: Sequence[int] = (64, 32, 16),
        *,
        mlp_embedding_dim: int = 0,
        generator: torch.Generator,
    ) -> None:
        super().__init__(num_users, num_items, embedding_dim)
        layers = tuple(mlp_layers)
        if not layers or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in layers):
            raise ValueError(f"NCF: mlp_layers must be a non-empty sequence of positive ints, got {mlp_layers!r}")
        self.mlp_layers = layers
        if isinstance(mlp_embedding_dim, bool) or not isinstance(mlp_embedding_dim, int) or mlp_embedding_dim < 0:
            raise ValueError(
                f"NCF: mlp_embedding_dim must be an int >= 0 (0 = embedding_dim), got {mlp_embedding_dim!r}"
            )
        d = self.embedding_dim
        self.mlp_embedding_dim = int(mlp_embedding_dim) or d
        m = self.mlp_embedding_dim
        self.user_embedding_gmf = new_embedding(self.num_users, d)
        self.user_embedding_mlp = new_embedding(self.num_users, m)
        self.item_embedding_gmf = new_embedding(self.num_items, d)
        self.item_embedding_mlp = new_embedding(self.num_items, m)
        blocks: list[nn.Module] = []
        width = 2 * m
        for size in layers:
            blocks += [new_linear(width, size), nn.ReLU()]
            width = size
        self.mlp = nn.Sequential(*blocks)
        self.output = new_linear(d + width, 1)
        self._check_partition()
        self.reset_parameters(generator)

    def _init_shared(self, generator: torch.Generator) -> None:
        for table in self.item_embedding_modules().values():
            _init_on_cpu(table, generator, init_embedding)
        for layer in [m for m in self.mlp if isinstance(m, nn.Linear)] + [self.output]:
            _init_on_cpu(layer, generator, init_linear)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """Logits ``(B,)`` float32 for user indices ``users`` (B,) and item indices ``items`` (B,), both int64."""
        gmf = self.user_embedding_gmf(users) * self.item_embedding_gmf(items)
        mlp = self.mlp(torch.cat([self.user_embedding_mlp(users), self.item_embedding_mlp(items)], dim=-1))
        return self.output(torch.cat([gmf, mlp], dim=-1)).squeeze(-1)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", mlp_embedding_dim={self.mlp_embedding_dim}, mlp_layers={self.mlp_layers}"
