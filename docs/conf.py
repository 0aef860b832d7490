"""Sphinx configuration of the fedrec-flwr documentation (Sphinx + furo + MyST, as Flower's own docs).

Build: ``python -m sphinx -W --keep-going -b html docs docs/_build/html`` (``tests/test_docs.py`` does this).
"""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # autodoc imports fedrec_flwr, clients, strategies from this checkout
os.environ.setdefault("OMP_NUM_THREADS", "1")

_project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]

project = "fedrec-flwr"
author = "fedrec-flwr contributors"
copyright = "fedrec-flwr contributors"
release = version = _project["version"]

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autodoc_default_options = {"show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = f"fedrec-flwr {release}"
html_static_path = ["_static"]
