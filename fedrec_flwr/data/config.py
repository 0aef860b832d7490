"""The data section of the run configuration: which dataset, where its files are, and how the split is built.

:class:`DataSection` declares the keys of the ``data`` group of ``[tool.flwr.app.config]`` (their defaults and
meanings are there); :class:`fedrec_flwr.config.RunConfig` inherits it. Beside the checks that hold anywhere
(:meth:`DataSection._check_data`), it resolves and checks the files a key names on the machine that reads the data
(:meth:`DataSection.generic_files`, :meth:`DataSection._check_data_files`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fedrec_flwr.data.datasets import DATASETS
from fedrec_flwr.data.split import TIE_RULES
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.sections.fields import config_key, int_list


@dataclass(frozen=True)
class DataSection:
    """The run-config keys of the dataset, its files and its leave-one-out split (``ks``: the evaluation cut-offs)."""

    dataset: str = config_key("dataset", choices=DATASETS)
    data_dir: str = config_key("data-dir")
    cache_dir: str = config_key("cache-dir")
    generic_file: str = config_key("generic-file")
    generic_columns: str = config_key("generic-columns")
    generic_attributes_file: str = config_key("generic-attributes-file")
    generic_attributes_user_column: str = config_key("generic-attributes-user-column")
    min_user_interactions: int = config_key("min-user-interactions", minimum=2)
    tie_rule: str = config_key("tie-rule", choices=TIE_RULES)
    holdout_validation: bool = config_key("holdout-validation")
    num_test_negatives: int = config_key("num-test-negatives", minimum=1)
    ks: str = config_key("ks")

    @property
    def k_values(self) -> tuple[int, ...]:
        """The cut-offs of ``ks`` as integers, e.g. ``(5, 10, 20)``."""
        return int_list("ks", self.ks)

    @property
    def generic_column_names(self) -> tuple[str, str, str | None, str | None]:
        """``generic-columns`` as ``(user, item, rating or None, timestamp or None)``: header names of the generic
        file, matched to the roles user, item, rating, timestamp.

        A name that is itself a role's name (``user``, ``item``, ``rating``, ``timestamp``, any case) takes that role
        wherever it stands, so ``"user,item,timestamp"`` (a file without ratings, its header listed) reads the
        ``timestamp`` column as timestamps. Every other name takes the role of its position,
        ``user,item[,rating[,timestamp]]``: ``"uid,iid,,ts"`` gives ``("uid", "iid", None, "ts")``.

        Raises:
            ConfigError: fewer than 2 or more than 4 names, a name used twice, two names for one role (naming both),
                or no user or item column.
        """
        roles = ("user", "item", "rating", "timestamp")
        columns = [c.strip() for c in str(self.generic_columns).split(",")]
        usage = (
            'give the header names of the user,item[,rating[,timestamp]] columns (e.g. "user,item,rating" '
            'for a file without timestamps, "uid,iid,,ts" for one without ratings)'
        )
        if len(columns) < 2 or len(columns) > 4:
            raise ConfigError(f"run-config key 'generic-columns' = {self.generic_columns!r}: {usage}")
        named = [c for c in columns if c]
        if len(set(named)) != len(named):
            raise ConfigError(f"run-config key 'generic-columns' = {self.generic_columns!r}: a column is named twice")
        chosen: dict[str, str] = {}
        by_name = [c for c in columns if c.lower() in roles]
        for name in by_name:
            role = name.lower()
            if role in chosen:
                raise ConfigError(
                    f"run-config key 'generic-columns' = {self.generic_columns!r}: columns "
                    f"{chosen[role]!r} and {name!r} both name the {role} column"
                )
            chosen[role] = name
        for position, name in enumerate(columns):
            if not name or name in by_name:
                continue
            role = roles[position]
            if role in chosen:
                raise ConfigError(
                    f"run-config key 'generic-columns' = {self.generic_columns!r}: column {name!r} is "
                    f"in the {role} position (position {position + 1} of user,item,rating,timestamp), "
                    f"but column {chosen[role]!r} names the {role} column by its name; {usage}"
                )
            chosen[role] = name
        for role in ("user", "item"):
            if role not in chosen:
                raise ConfigError(
                    f"run-config key 'generic-columns' = {self.generic_columns!r}: no {role} column; {usage}"
                )
        return chosen["user"], chosen["item"], chosen.get("rating"), chosen.get("timestamp")

    def generic_files(self) -> tuple[Path, Path | None]:
        """The generic dataset's ``(interactions file, attributes file or None)`` on this machine.

        A ``data-dir`` that is a file is the interactions file itself; one that is a folder is where relative
        ``generic-file`` / ``generic-attributes-file`` paths are resolved; empty: they resolve against the working
        directory (``$FEDREC_DATA_DIR`` is not used for generic data).

        Raises:
            ConfigError: the interactions or attributes file does not exist (the message names the key, the value
                and the resolved path), ``data-dir`` does not exist, or names a file while ``generic-file`` names
                another.
        """
        base_text = self.data_dir
        base = Path(base_text).expanduser() if base_text else None
        key_of_base = "data-dir"
        if base is not None and not base.exists():
            raise ConfigError(f"run-config key '{key_of_base}' = {base_text!r}: no such file or folder")
        if base is not None and base.is_file():
            if self.generic_file and Path(self.generic_file).expanduser().resolve() != base.resolve():
                raise ConfigError(
                    f"run-config key '{key_of_base}' = {base_text!r} is a file, so it is the "
                    f"interactions file, but 'generic-file' = {self.generic_file!r} names another; "
                    "set one of them, or make data-dir the folder holding generic-file"
                )
            interactions, folder = base, base.parent
        else:
            if not self.generic_file:
                raise ConfigError(
                    f"run-config key 'generic-file' is empty and 'data-dir' = {base_text!r} is a "
                    "folder: name the interactions file in 'generic-file' (relative to data-dir)"
                )
            interactions, folder = _resolve(self.generic_file, base), base
        if not interactions.is_file():
            raise ConfigError(
                f"run-config key 'generic-file' = {self.generic_file!r}: file {str(interactions)!r} "
                "not found" + (f" (resolved against data-dir {base_text!r})" if base is not None else "")
            )
        attributes = None
        if self.generic_attributes_file:
            attributes = _resolve(self.generic_attributes_file, folder)
            if not attributes.is_file():
                raise ConfigError(
                    f"run-config key 'generic-attributes-file' = {self.generic_attributes_file!r}: file "
                    f"{str(attributes)!r} not found"
                    + (f" (resolved against data-dir {base_text!r})" if folder is not None else "")
                )
        return interactions, attributes

    def _check_data_files(self, data_dir: str | None = None) -> None:
        """The data half of :meth:`fedrec_flwr.config.RunConfig.check_files`: ``data-dir``, a generic dataset's
        files and ``cache-dir`` on this machine (``data_dir`` overrides ``data-dir`` for the named datasets).

        Raises:
            ConfigError: ``data-dir`` does not exist (or is a file for a named dataset), ``cache-dir`` is a file, or
                a generic dataset's file is missing (:meth:`generic_files`).
        """
        base = self.data_dir if data_dir is None else (data_dir or "")
        if self.dataset == "generic":
            self.generic_files()
        elif base:
            path = Path(base).expanduser()
            key = "data-dir" if base == self.data_dir else "data-dir ($FEDREC_DATA_DIR)"
            if not path.exists():
                raise ConfigError(
                    f"run-config key '{key}' = {base!r}: no such folder (it should hold the "
                    f"{self.dataset} files, or a '{self.dataset}' folder with them)"
                )
            if not path.is_dir():
                raise ConfigError(
                    f"run-config key '{key}' = {base!r} is a file; for dataset = {self.dataset!r} it "
                    "must be the folder holding the dataset's files"
                )
        if (
            self.cache_dir
            and Path(self.cache_dir).expanduser().exists()
            and not Path(self.cache_dir).expanduser().is_dir()
        ):
            raise ConfigError(f"run-config key 'cache-dir' = {self.cache_dir!r} is a file, not a folder")

    def _check_data(self) -> None:
        """The relations among the data keys that hold on every machine (``ks``, the generic keys and
        ``min-user-interactions``); called by :meth:`fedrec_flwr.config.RunConfig.from_mapping`.

        Raises:
            ConfigError: naming the key and value.
        """
        ks = self.k_values
        if not ks:
            raise ConfigError("run-config key 'ks' = '': give at least one cut-off, e.g. \"5,10,20\"")
        if len(set(ks)) != len(ks):
            raise ConfigError(f"run-config key 'ks' = {self.ks!r}: a cut-off is given twice; give each K once")
        if max(ks) > self.num_test_negatives + 1:
            raise ConfigError(
                f"run-config key 'ks' = {self.ks!r}: K may not exceed the {self.num_test_negatives + 1} ranked candidates"
            )
        if self.dataset == "generic":
            if not self.generic_file and not self.data_dir:
                raise ConfigError(
                    "run-config key 'generic-file' is empty but dataset = 'generic' needs the "
                    "interactions file: set 'generic-file' (relative paths resolve against 'data-dir'), "
                    "or set 'data-dir' to the file itself"
                )
            self.generic_column_names  # noqa: B018 - validates
            if self.generic_attributes_user_column and not self.generic_attributes_file:
                raise ConfigError(
                    f"run-config key 'generic-attributes-user-column' = "
                    f"{self.generic_attributes_user_column!r} is set but 'generic-attributes-file' is "
                    "empty: name the attributes file, or leave the key empty"
                )
            if (
                self.generic_attributes_user_column != self.generic_attributes_user_column.strip()
                or "," in self.generic_attributes_user_column
            ):
                raise ConfigError(
                    f"run-config key 'generic-attributes-user-column' = "
                    f"{self.generic_attributes_user_column!r}: give one column name of the attributes "
                    "file's header, without surrounding spaces or commas"
                )
        elif self.generic_file or self.generic_attributes_file or self.generic_attributes_user_column:
            key = (
                "generic-file"
                if self.generic_file
                else "generic-attributes-file"
                if self.generic_attributes_file
                else "generic-attributes-user-column"
            )
            raise ConfigError(
                f"run-config key '{key}' is set but dataset = {self.dataset!r} does not read it "
                "(it is for dataset = 'generic')"
            )
        need = 3 if self.holdout_validation else 2
        if self.min_user_interactions < need:
            raise ConfigError(
                f"run-config key 'min-user-interactions' = {self.min_user_interactions}: must be >= {need} (the "
                f"held-out item{'s' if need == 3 else ''} plus at least one training positive"
                + (", with holdout-validation = true)" if need == 3 else ")")
            )


def _resolve(name: str, folder: Path | None) -> Path:
    path = Path(name).expanduser()
    return path if path.is_absolute() or folder is None else folder / path
