"""The ``fedrec`` command: run the app on a local simulation, stop what a killed run left, and read the run config.

::

    fedrec --version
    fedrec config [KEY]                      every run-config key with its default and meaning (or one key)
    fedrec presets [NAME] [--dataset D]      the validation-tuned recipes (or one, as a --run-config file)
    fedrec run [KEY=VALUE ...] [--run-config FILE.toml] [--preset NAME] [--num-supernodes N] [--flwr-home DIR]
               [--ray-address HOST:PORT] [--federation-config KEY=VALUE ...] [--timeout SECONDS] [--verbose] [--debug]
    fedrec stop [--flwr-home DIR]

``fedrec run`` is :mod:`fedrec_flwr.launch`'s ``run`` (``python -m fedrec_flwr.launch run`` does the same, with the
same checks, exit statuses and ``key=value`` parsing) plus ``--run-config``: a TOML file of run-config keys
(``num-server-rounds = 20``), read first, which ``key=value`` words then override; and ``--preset NAME`` (or
``preset = "NAME"`` in the file, ``preset=NAME`` among the words): a validation-tuned recipe for the run's dataset
(:mod:`fedrec_flwr.presets`) under both. On a terminal it shows a live progress bar (:mod:`fedrec_flwr.progress`);
piped or in CI it prints one plain line per round.

Exit statuses: 0 the run finished, 1 it started and failed, 2 bad input found before anything started (one
``error:`` line), 124 ``--timeout``, 128 + N a signal N stopped it.
"""

from __future__ import annotations

import difflib
import re
import shutil
import sys
import textwrap
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import click
import typer

from fedrec_flwr import launch
from fedrec_flwr.config_reference import KeyEntry, entries
from fedrec_flwr.errors import ConfigError


# ------------------------------------------------------------------------------------------ config reference
def unknown_key_message(name: str, known: Sequence[str]) -> str:
    """``unknown run-config key 'datset'; did you mean 'dataset'?`` (or the list command without a close match)."""
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}?" if close else "`fedrec config` lists every key"
    return f"unknown run-config key {name!r}; {hint}"


def format_key(key: KeyEntry, width: int) -> str:
    """``key = default`` and, indented below, its meaning, allowed values and range wrapped to ``width`` columns
    (one :class:`~fedrec_flwr.config_reference.KeyEntry` of the generated reference)."""
    lines = [f"{key.name} = {key.default}"]
    notes = (
        [key.meaning]
        + ([f"allowed: {' | '.join(key.allowed)}"] if key.allowed else [])
        + ([f"range: {key.bounds}"] if key.bounds else [])
    )
    for note in filter(None, notes):
        lines.append(
            textwrap.fill(
                note,
                width=max(40, width),
                initial_indent="    ",
                subsequent_indent="    ",
                break_on_hyphens=False,
                break_long_words=False,
            )
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- run-config file
def read_run_config_file(path: str | Path) -> tuple[dict[str, Any], dict[str, int]]:
    """The run-config keys of a TOML file (``key = value`` at its top level) and the line each is on.

    Raises:
        ConfigError: naming the file and the line: it cannot be read, is not TOML, holds a table (``[section]``)
            or a value that is not a string, number or boolean.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"--run-config {path}: cannot read it ({getattr(err, 'strerror', None) or err})") from None
    try:
        values = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        where = re.search(r"\s*\(at line (\d+), column (\d+)\)$", str(err))
        problem = str(err)[: where.start()] if where else str(err)
        at = f", line {where.group(1)}, column {where.group(2)}" if where else ""
        raise ConfigError(f"--run-config {path}{at}: not TOML ({problem})") from None
    lines = {}
    for key, value in values.items():
        line = _line_of(text, key)
        if isinstance(value, dict):
            shown = text.splitlines()[line - 1].strip() if line else f"[{key}]"
            raise ConfigError(
                f"--run-config {path}, line {line}: {shown} is a table; the file holds run-config keys "
                "at its top level, one `key = value` a line (see `fedrec config`)"
            )
        if not isinstance(value, (str, int, float, bool)):
            raise ConfigError(
                f"--run-config {path}, line {line}: {key} = {value!r}: a run-config value is a string, "
                'a number or a boolean (a list of users: forget-users = "3,17")'
            )
        lines[key] = line
    return values, lines


def _line_of(text: str, key: str) -> int:
    """The line (1-based) where ``key`` is set or opened as a table; 0 when not found."""
    pattern = re.compile(rf"^\s*(?:\[+\s*)?[\"']?{re.escape(key)}[\"']?\s*[=.\]]")
    for number, line in enumerate(text.splitlines(), start=1):
        if pattern.match(line):
            return number
    return 0


def merge_run_config(file_values: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The file's values, then the command line's ``key=value`` overrides (which win)."""
    return {**dict(file_values), **dict(overrides)}


# ------------------------------------------------------------------------------------------------- commands
app = typer.Typer(
    name="fedrec",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Federated recommendation on Flower: run the app on a local simulation, and read its run config.",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"fedrec {package_version()}")
        raise typer.Exit(0)


def package_version() -> str:
    """The installed ``fedrec-flwr`` package's version; from a checkout that is not installed, ``pyproject.toml``'s
    ``[project] version``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fedrec-flwr")
    except PackageNotFoundError:
        with open(launch.PROJECT_ROOT / "pyproject.toml", "rb") as handle:
            return str(tomllib.load(handle)["project"]["version"])


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the package version and exit."
    ),
) -> None:
    """Federated recommendation on Flower: run the app on a local simulation, and read its run config."""


@app.command("config")
def config_command(key: str | None = typer.Argument(None, help="One key (default: every key).")) -> None:
    """Print every run-config key with its default and meaning, or one KEY."""
    keys = entries(launch.PROJECT_ROOT / "pyproject.toml")
    width = min(shutil.get_terminal_size((100, 24)).columns, 120) - 1
    if key is not None:
        found = [k for k in keys if k.name == key]
        if not found:
            raise ConfigError(unknown_key_message(key, [k.name for k in keys]))
        typer.echo(format_key(found[0], width))
        return
    group = None
    for item in keys:
        if item.group != group:
            group = item.group
            typer.echo(f"{'' if item is keys[0] else chr(10)}# {group}" if group else "")
        typer.echo(format_key(item, width))


@app.command("run", context_settings={"allow_interspersed_args": True})
def run_command(
    overrides: list[str] | None = typer.Argument(
        None, metavar="[KEY=VALUE]...", help="Run-config overrides (they win over --run-config)."
    ),
    run_config: Path | None = typer.Option(
        None, "--run-config", metavar="FILE.toml", help="TOML file of run-config keys (key = value a line)."
    ),
    preset: str | None = typer.Option(
        None,
        "--preset",
        metavar="NAME",
        help="Start from a validation-tuned recipe, e.g. fedrecgel-tuned, for the "
        "run's dataset (`fedrec presets` lists them).",
    ),
    num_supernodes: int | None = typer.Option(
        None, "--num-supernodes", metavar="N", help="Simulated SuperNodes (default: ceil(users / users-per-node))."
    ),
    flwr_home: str | None = typer.Option(
        None, "--flwr-home", metavar="DIR", help="Flower home (default $FLWR_HOME, else ~/.flwr)."
    ),
    ray_address: str | None = typer.Option(
        None, "--ray-address", metavar="HOST:PORT", help="Run the client actors on this existing Ray cluster."
    ),
    federation_config: list[str] | None = typer.Option(
        None,
        "--federation-config",
        metavar="KEY=VALUE",
        help="Another flwr simulation-config key, e.g. client-resources-num-cpus=1 (repeatable).",
    ),
    timeout: str | None = typer.Option(
        None, "--timeout", metavar="SECONDS", help="Stop the run SECONDS after flwr run starts (exit 124)."
    ),
    verbose: bool = typer.Option(False, "--verbose", help="Print Flower's whole log."),
    debug: bool = typer.Option(False, "--debug", help="Print tracebacks of errors caught before the run starts."),
) -> None:
    """Run the app with flwr run on a fresh local SuperLink, then stop it."""
    from fedrec_flwr.config import default_mapping
    from fedrec_flwr.progress import RunDisplay

    seconds, given, federation = launch.parse_run_options(overrides or [], federation_config or [], timeout)
    file_values, lines = read_run_config_file(run_config) if run_config is not None else ({}, {})
    defaults = default_mapping(launch.PROJECT_ROOT / "pyproject.toml")
    named = (given.pop(PRESET_KEY, None), preset, file_values.pop(PRESET_KEY, None))  # words, flag, file
    name = next((n for n in named if n is not None), None)
    merged = merge_run_config(file_values, given)
    if name is not None:
        from fedrec_flwr import presets

        dataset = merged.get("dataset", defaults["dataset"])
        merged = merge_run_config(presets.resolve(str(name), str(dataset)), merged)
    try:
        num_supernodes = launch.check_run(merged, num_supernodes)
    except ConfigError as err:  # a key the file set: say where
        raise ConfigError(_from_file(str(err), run_config, lines, given)) from None
    total = merged.get("num-server-rounds", defaults["num-server-rounds"])
    with RunDisplay(int(total) if isinstance(total, int) else 0) as display:
        result = launch.flwr_run(
            merged,
            num_supernodes=num_supernodes,
            flwr_home=flwr_home,
            federation_config=federation,
            ray_address=ray_address,
            verbose=verbose,
            timeout=seconds,
            check=False,
            display=display,
        )
    raise typer.Exit(result.returncode)


PRESET_KEY = "preset"
"""``preset = "NAME"`` in a ``--run-config`` file or ``preset=NAME`` among the words: ``--preset NAME`` (the front
end's own key: it never reaches the run config; the words win over ``--preset``, which wins over the file)."""


@app.command("presets")
def presets_command(
    name: str | None = typer.Argument(None, help="One preset: print its run-config keys as TOML."),
    dataset: str = typer.Option("ml-100k", "--dataset", help="The dataset whose tuned values to use."),
) -> None:
    """List the validation-tuned recipes with their test HR@10 at round 100, or print one as a --run-config file."""
    from fedrec_flwr import presets

    if name is not None:
        keys = presets.resolve(name, dataset)
        row = presets.table_row(name, dataset)
        typer.echo(
            f"# {name} on {dataset}: {presets.presets()[name].method}, "
            f"{presets.selection(presets.presets()[name].base, dataset)['selected-on']}"
        )
        if row:
            typer.echo(
                f"# test HR@10 {float(row['HR@10-mean']):.4f}, NDCG@10 {float(row['NDCG@10-mean']):.4f} at "
                f"round {row['round']} (mean of {row['seeds']} seeds, experiments/tuning/results)"
            )
        typer.echo(f"dataset = {launch.toml_value(dataset)}")
        for key, value in keys.items():
            typer.echo(f"{key} = {launch.toml_value(value)}")
        return
    for preset in presets.presets().values():
        typer.echo(f"{preset.name}  ({preset.method})")
        for data in presets.datasets():
            try:
                chosen = presets.setting(preset.name, data)
            except ConfigError:
                continue
            tuned = ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(chosen.items()))
            row = presets.table_row(preset.name, data)
            figure = (
                f"test HR@10 {float(row['HR@10-mean']):.4f} at round 100 ({row['seeds']} seeds)"
                if row
                else "no test figure"
            )
            typer.echo(f"    {data:<13} {figure}; tuned {tuned}")


def _from_file(message: str, path: Path | None, lines: Mapping[str, int], given: Mapping[str, Any]) -> str:
    """``message`` with ``(--run-config FILE, line N)`` added when it names a key the file set (and the command line
    did not)."""
    named = []
    for key, line in lines.items():
        found = re.search(rf"['\"]{re.escape(key)}['\"]", message)
        if key not in given and found:
            named.append((found.start(), key, line))
    if not named:
        return message
    _, key, line = min(named)  # the key the message names first
    return f"{message} (--run-config {path}, line {line}: {key})"


@app.command("stop")
def stop_command(
    flwr_home: str | None = typer.Option(
        None, "--flwr-home", metavar="DIR", help="Flower home (default $FLWR_HOME, else ~/.flwr)."
    ),
) -> None:
    """Stop SuperLinks left by runs whose launcher was killed (never a running run)."""
    raise typer.Exit(launch.stop_main(flwr_home))


def main(argv: Sequence[str] | None = None) -> int:
    """The ``fedrec`` console script; returns the exit status (module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = typer.main.get_command(app)

    def body() -> int:
        try:  # click's parse and invoke without its main(), which turns Ctrl-C and SIGTERM alike into status 130
            with command.make_context("fedrec", list(argv)) as ctx:
                status = command.invoke(ctx)
        except click.exceptions.Exit as done:
            return int(done.exit_code)
        except click.UsageError as err:  # one line, as every other refusal
            if not err.format_message():  # `fedrec` alone: the help was printed
                return 0
            where = f"fedrec {err.ctx.info_name} --help" if err.ctx is not None and err.ctx.parent else "fedrec --help"
            where = where.replace("fedrec fedrec", "fedrec")
            print(f"error: {err.format_message()} (see `{where}`)", file=sys.stderr)
            return 2
        except click.Abort:  # a prompt's Ctrl-C
            raise KeyboardInterrupt() from None
        return int(status or 0)

    return launch.guarded(body, debug="--debug" in argv)


if __name__ == "__main__":
    sys.exit(main())
