"""What persists: the ServerApp's checkpoints, the clients' private state files and their keys, and the results
folder (config.json, metrics, summary, failure records, its lock).
"""
