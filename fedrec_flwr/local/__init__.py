"""Local training on a client: the per-user trainer and losses, SAM (FedRecGEL's decoupled step), and the
vectorized block engine that trains many users of one node at once.
"""
