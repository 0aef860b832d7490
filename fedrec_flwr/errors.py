"""Exceptions raised by fedrec-flwr.

Every error a user can cause (bad data, bad configuration) is one of these, with a message that names the
file, line, key or value at fault.
"""


class FedRecError(Exception):
    """Base class of every error fedrec-flwr raises on purpose."""


class DataError(FedRecError, ValueError):
    """A dataset file, download or cache is missing, malformed or inconsistent."""


class ConfigError(FedRecError, ValueError):
    """A run-config key is unknown, ill-typed or out of range."""
