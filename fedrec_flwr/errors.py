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


def reply_error_line(reason: str) -> str:
    """The ClientApp's own error in an error reply's ``reason``: its last ``SomeError: message`` line (under Ray the
    reason is the actor's whole traceback, hundreds of characters around the cause, which is on a line of its own),
    else the reason as it is. Used wherever a node's failure is reported in one line."""
    import re

    found = re.findall(r"^(?:[A-Za-z_][\w.]*\.)?([A-Z]\w*(?:Error|Exception|Violation|Failed): .+)$", reason,
                       flags=re.MULTILINE)
    return found[-1] if found else reason
