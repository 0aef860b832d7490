"""Build hook: the wheel carries the app's ``pyproject.toml`` as ``fedrec_flwr/_app/pyproject.toml``.

``pyproject.toml`` is both the package's build file and the Flower app's manifest (its ``[tool.flwr.app.config]`` holds
every run-config key's default). An installed package has no source checkout to read it from, so ``build_py`` copies
it into the package; :func:`fedrec_flwr.config.app_root` finds it there. The copy's ``fab-include`` names only
``pyproject.toml``: an installed app ships no code in its FAB, and its ServerApp and ClientApps import the installed
package (Flower refuses a ``fab-include`` pattern that matches nothing). All other metadata is in ``pyproject.toml``.
"""

import re
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithApp(build_py):
    """``build_py`` that also writes ``<build>/fedrec_flwr/_app/pyproject.toml``."""

    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "fedrec_flwr" / "_app" / "pyproject.toml"
        target.parent.mkdir(parents=True, exist_ok=True)
        text = (Path(__file__).resolve().parent / "pyproject.toml").read_text(encoding="utf-8")
        text, found = re.subn(
            r"^fab-include = \[.*?\]",
            'fab-include = ["/pyproject.toml"]',
            text,
            count=1,
            flags=re.MULTILINE | re.DOTALL,
        )
        if found != 1:
            raise RuntimeError("pyproject.toml: no fab-include = [...] under [tool.flwr.app] to rewrite")
        target.write_text(text, encoding="utf-8")


setup(cmdclass={"build_py": BuildPyWithApp})
