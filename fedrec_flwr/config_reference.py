"""The run-config reference, generated from its one source.

Every run-config key is declared once, in ``[tool.flwr.app.config]`` of ``pyproject.toml``: its default (the TOML
value) and its meaning (the comment on the same line; the ``# --- name ---`` lines above a group of keys name the
group). :class:`fedrec_flwr.config.RunConfig` (and the sections it inherits, :mod:`fedrec_flwr.sections`) gives each key its
Python type and its constraints (allowed values, minimum, maximum). This module joins the two into one :class:`KeyEntry` per key and renders them as the Markdown page
``docs/reference/run-config.md``.

Usage::

    python -m fedrec_flwr.config_reference                 # print the page
    python -m fedrec_flwr.config_reference --write docs/reference/run-config.md
    python -m fedrec_flwr.config_reference --check docs/reference/run-config.md   # exit 1 if the file is stale

:func:`entry` returns one key's entry (``fedrec config KEY`` prints it); :func:`entries` all of them, in the order of
``pyproject.toml``; :func:`render` the whole page.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedrec_flwr.config import INT_MAX, RunConfig, find_pyproject
from fedrec_flwr.errors import ConfigError

_KEY_LINE = re.compile(r"^([a-z0-9][a-z0-9-]*)\s*=")
_GROUP_LINE = re.compile(r"^#\s*-+\s*(.*?)\s*-*\s*$")
_TYPE_NAMES = {"str": "string", "int": "integer", "float": "float", "bool": "boolean"}


@dataclass(frozen=True)
class KeyEntry:
    """One run-config key as the reference shows it.

    Attributes:
        name: the kebab-case key, e.g. ``"num-server-rounds"``.
        type: ``"string"``, ``"integer"``, ``"float"`` or ``"boolean"`` (from :class:`RunConfig`'s annotation).
        default: the default as written in ``pyproject.toml`` (TOML text, e.g. ``100``, ``"ml-100k"``).
        meaning: the key's comment in ``pyproject.toml``.
        allowed: the allowed values (a tuple of strings) for a key with a fixed set of choices, else ``()``.
        bounds: the numeric range as text (e.g. ``">= 1"``, ``"0 < x <= 1"``), ``""`` where there is none.
        group: the group the key is declared in (``"data"``, ``"federation"``, ...).
    """

    name: str
    type: str
    default: str
    meaning: str
    allowed: tuple[str, ...]
    bounds: str
    group: str

    def as_text(self) -> str:
        """The entry as a few plain-text lines (for a terminal)."""
        lines = [f"{self.name} = {self.default}    ({self.type})", f"  {self.meaning}"]
        if self.allowed:
            lines.append(f"  allowed: {' | '.join(self.allowed)}")
        if self.bounds:
            lines.append(f"  range: {self.bounds}")
        return "\n".join(lines)


def _split_comment(line: str) -> tuple[str, str]:
    """``key = value  # comment`` -> (``key = value``, ``comment``): the first ``#`` outside the TOML value."""
    for match in re.finditer("#", line):
        head = line[: match.start()]
        try:
            tomllib.loads(head)
        except tomllib.TOMLDecodeError:
            continue
        return head.rstrip(), line[match.end() :].strip()
    return line.rstrip(), ""


def _declared(pyproject: Path) -> list[tuple[str, str, str, str]]:
    """(key, default as TOML text, comment, group) for each line of ``[tool.flwr.app.config]``, in file order."""
    out, group, inside = [], "", False
    for number, line in enumerate(pyproject.read_text(encoding="utf-8").splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("["):
            inside = stripped == "[tool.flwr.app.config]"
            continue
        if not inside or not stripped:
            continue
        group_match = _GROUP_LINE.match(stripped)
        if group_match and group_match.group(1):
            group = group_match.group(1)
            continue
        key_match = _KEY_LINE.match(stripped)
        if key_match is None:
            continue
        head, comment = _split_comment(stripped)
        if not comment:
            raise ConfigError(
                f"{pyproject}, line {number}: run-config key '{key_match.group(1)}' has no comment saying what it means"
            )
        out.append((key_match.group(1), head.partition("=")[2].strip(), comment, group))
    return out


def _bounds(meta: dict[str, Any], kind: str) -> str:
    low, high, positive = meta.get("min"), meta.get("max"), meta.get("positive")
    fmt = lambda v: f"{v:g}" if isinstance(v, float) else str(v)
    if positive and high is not None:
        return f"0 < x <= {fmt(high)}"
    if positive:
        return "> 0"
    if low is not None and high is not None:
        return f"{fmt(low)} <= x <= {fmt(high)}"
    if low is not None:
        return f">= {fmt(low)}"
    return ""


def entries(pyproject: str | os.PathLike | None = None) -> list[KeyEntry]:
    """Every run-config key, in the order of ``pyproject.toml``.

    Raises:
        ConfigError: a key of ``pyproject.toml`` without a comment, or one that :class:`RunConfig` does not declare
            (or the other way round), naming the key.
    """
    path = Path(pyproject) if pyproject else find_pyproject()
    fields = {f.metadata["key"]: f for f in dataclasses.fields(RunConfig) if f.metadata.get("key")}
    out = []
    for name, default, comment, group in _declared(path):
        field = fields.pop(name, None)
        if field is None:
            raise ConfigError(f"{path}: run-config key '{name}' is not a field of fedrec_flwr.config.RunConfig")
        kind = _TYPE_NAMES.get(str(field.type), str(field.type))
        bounds = _bounds(dict(field.metadata), kind) if kind in ("integer", "float") else ""
        out.append(KeyEntry(name, kind, default, comment, tuple(field.metadata["choices"]), bounds, group))
    if fields:
        raise ConfigError(f"{path}: RunConfig key(s) {sorted(fields)} missing from [tool.flwr.app.config]")
    return out


def entry(name: str, pyproject: str | os.PathLike | None = None) -> KeyEntry:
    """One key's entry (name, type, default, meaning, allowed values, range).

    Raises:
        ConfigError: ``name`` is not a run-config key (the message names it).
    """
    for item in entries(pyproject):
        if item.name == name:
            return item
    raise ConfigError(f"'{name}' is not a run-config key (python -m fedrec_flwr.config_reference lists them)")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render(pyproject: str | os.PathLike | None = None) -> str:
    """The reference page (Markdown, MyST), one table per group of keys."""
    items = entries(pyproject)
    lines = [
        "# Run-config keys",
        "",
        "<!-- Generated by `python -m fedrec_flwr.config_reference --write docs/reference/run-config.md` from",
        "     [tool.flwr.app.config] in pyproject.toml and fedrec_flwr/config.py. Do not edit by hand. -->",
        "",
        f"Every key of a run, {len(items)} in all, with its type, default and meaning. The defaults and meanings are",
        "those of `[tool.flwr.app.config]` in `pyproject.toml`; the types, allowed values and ranges are those that",
        "`fedrec_flwr.config.RunConfig` checks (a value outside them stops the run before it starts, naming the key).",
        'Override a key with `key=value` on the launcher\'s command line, `--run-config "key=value"` with `flwr run`,',
        "or `make_run_config(key_name=value)` in Python (dashes become underscores). Integer keys without a stated",
        f"maximum are at most {INT_MAX} (2^31 - 1).",
        "",
    ]
    groups: dict[str, list[KeyEntry]] = {}
    for item in items:
        groups.setdefault(item.group or "other", []).append(item)
    for group, members in groups.items():
        lines += [f"## {group[:1].upper() + group[1:]}", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for item in members:
            meaning = item.meaning
            if item.allowed:
                meaning += f" *Allowed:* {', '.join(f'`{v}`' for v in item.allowed)}."
            if item.bounds:
                meaning += f" *Range:* {item.bounds}."
            lines.append(f"| `{item.name}` | {item.type} | `{_cell(item.default)}` | {_cell(meaning)} |")
        lines.append("")
    return "\n".join(lines)


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(temp, path)


def main(argv: list[str] | None = None) -> int:
    """Print, write (``--write FILE``) or check (``--check FILE``: exit 1 if it differs) the reference page."""
    parser = argparse.ArgumentParser(
        prog="python -m fedrec_flwr.config_reference", description="Generate the run-config reference page."
    )
    parser.add_argument("--write", metavar="FILE", help="write the page to FILE (atomically)")
    parser.add_argument("--check", metavar="FILE", help="exit 1 if FILE is not the page this code generates")
    parser.add_argument("--pyproject", metavar="FILE", help="the pyproject.toml to read (default: the project's)")
    args = parser.parse_args(argv)
    try:
        text = render(args.pyproject)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.check:
        current = Path(args.check).read_text(encoding="utf-8") if Path(args.check).is_file() else ""
        if current != text:
            print(
                f"{args.check} is stale: run python -m fedrec_flwr.config_reference --write {args.check}",
                file=sys.stderr,
            )
            return 1
        return 0
    if args.write:
        _write_atomic(Path(args.write), text)
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
