"""fedrec-flwr: federated recommendation on Flower, one client per user.

The package's only import name is ``fedrec_flwr``. Its client algorithms and server strategies live in the repository's
top-level ``clients/`` and ``strategies/`` folders and import as :mod:`fedrec_flwr.clients` and
:mod:`fedrec_flwr.strategies`:

- an installed wheel holds them as real subpackages (setuptools' ``package-dir`` mapping in ``pyproject.toml``);
- a source checkout, and the Flower app folder that ``flwr run`` unpacks from the FAB, hold them beside this package;
  :class:`_SiblingFolders` maps the two names there, and nothing else.

So a user's own ``strategies/`` or ``clients/`` folder on ``sys.path`` (a common name in Flower projects) never shadows
them.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

__all__ = ["__version__"]

SUBPACKAGE_FOLDERS = ("clients", "strategies")
"""Top-level folders of the repository that import as ``fedrec_flwr.<name>``."""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fedrec-flwr")
    except PackageNotFoundError:  # a source tree on sys.path that was never installed
        return "0+unknown"


__version__ = _version()


class _SiblingFolders(importlib.abc.MetaPathFinder):
    """Finds ``fedrec_flwr.clients`` and ``fedrec_flwr.strategies`` in folders beside the package (source tree, FAB).

    Only the two package names themselves are mapped; their modules are then found through the package's
    ``__path__`` like any other submodule.
    """

    def __init__(self, folders: dict[str, Path]) -> None:
        self.folders = folders

    def find_spec(self, fullname, path=None, target=None):  # noqa: D102 - importlib protocol
        folder = self.folders.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


def _map_sibling_folders() -> None:
    here = Path(__file__).resolve().parent
    folders = {
        f"{__name__}.{name}": here.parent / name
        for name in SUBPACKAGE_FOLDERS
        if not (here / name).is_dir() and (here.parent / name / "__init__.py").is_file()
    }
    if folders and not any(isinstance(f, _SiblingFolders) and f.folders == folders for f in sys.meta_path):
        sys.meta_path.insert(0, _SiblingFolders(folders))


_map_sibling_folders()
