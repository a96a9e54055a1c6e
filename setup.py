"""The one build step pyproject.toml cannot express: install ``monarch_jupyter.pth`` at the top of site-packages.

Python runs the ``import`` line of every ``.pth`` file there at start-up; this one installs the hook in
``shim/_monarch_jupyter_hook.py`` that keeps ``%load_ext monarch`` working beside PyTorch Monarch
(docs/installation.md, "The `monarch` name"). Everything else is in pyproject.toml.

Editable installs (``pip install -e``) get no ``.pth``: setuptools' editable wheels carry only its own finder.
There ``import monarch`` still finds ``shim/monarch.py`` when no other ``monarch`` is installed.
"""

from __future__ import annotations

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "monarch_jupyter.pth"


class BuildPyWithPth(build_py):
    """build_py that also puts ``shim/monarch_jupyter.pth`` at the root of the wheel (= site-packages)."""

    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            self.copy_file(os.path.join("shim", PTH), os.path.join(self.build_lib, PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = list(super().get_outputs(include_bytecode))
        if not self.editable_mode:
            outputs.append(os.path.join(self.build_lib, PTH))
        return outputs


setup(cmdclass={"build_py": BuildPyWithPth})
