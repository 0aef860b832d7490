"""Privacy of what the server sees: secure aggregation (SecAgg+) of arrays over a set of nodes, so that a curious
server learns only their sum (:mod:`fedrec_flwr.privacy.secagg`)."""

from fedrec_flwr.privacy.secagg import SecAggError, SecureSum, secure_sum

__all__ = ["SecAggError", "SecureSum", "secure_sum"]
