"""Exceptions raised by fedrec-flwr.

Every error a user can cause (bad data, bad configuration) is one of these, with a message that names the
file, line, key or value at fault.
"""


def escape_controls(text: str) -> str:
    """``text`` with every character that is not printable (a newline, a carriage return, a tab, an escape, a
    bidirectional override, ...) written as its Python escape (``\\n``, ``\\x1b``, ``\\u202e``), so that a value
    or path shown to the user is shown on one line and as it is."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class FedRecError(Exception):
    """Base class of every error fedrec-flwr raises on purpose. Its message is one line: control characters of the
    values it shows are escaped (:func:`escape_controls`)."""

    def __init__(self, *args) -> None:
        super().__init__(*(escape_controls(a) if isinstance(a, str) else a for a in args))


class OneLineRecords:
    """A :mod:`logging` filter for a handler: each record's message with its control characters escaped
    (:func:`escape_controls`), so one record is one console line (a path with a newline is not cut in two, and a
    reader keeping a record's first line keeps all of it). A traceback, formatted apart, keeps its lines."""

    def filter(self, record) -> bool:
        message = record.getMessage()
        if not message.isprintable():
            record.msg, record.args = escape_controls(message), None
        return True


class DataError(FedRecError, ValueError):
    """A dataset file, download or cache is missing, malformed or inconsistent."""


class ConfigError(FedRecError, ValueError):
    """A run-config key is unknown, ill-typed or out of range."""


def reply_error_line(reason: str) -> str:
    """The ClientApp's own error in an error reply's ``reason``: its last ``SomeError: message`` line (under Ray the
    reason is the actor's whole traceback, hundreds of characters around the cause, which is on a line of its own),
    else the reason as it is. Used wherever a node's failure is reported in one line."""
    import re

    found = re.findall(
        r"^(?:[A-Za-z_][\w.]*\.)?([A-Z]\w*(?:Error|Exception|Violation|Failed): .+)$", reason, flags=re.MULTILINE
    )
    return found[-1] if found else reason
