"""The two Flower apps and what they run on: the ClientApp and its query handlers, the ServerApp, the per-node
runtime, the preflight checks, the message window and the simulation link-state patch.
"""
