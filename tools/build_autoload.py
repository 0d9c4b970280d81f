"""setuptools commands that ship ``tools/ztriton-autoload.pth`` at the top of site-packages.

Python runs an ``import`` line of every ``.pth`` file in site-packages at start-up (the ``site``
module), which is how the DeepSpeed config key works without ``import ztriton``: the line imports
the ``ztriton`` package, which only registers its lazy import hooks (no torch, DeepSpeed or
transformers import; see ``ztriton/__init__.py``), unless ``ZTRITON_AUTOLOAD=0``. pytest-cov shipped
its ``.pth`` the same way.

* A wheel (``pip wheel .``, ``pip install .``): :class:`BuildPy` copies the file into ``build_lib``,
  whose whole tree becomes the wheel's purelib root.
* An editable install (``pip install -e .``, PEP 660): setuptools builds the editable wheel from
  files it writes itself (a finder module and its own ``__editable__.*.pth``), not from
  ``build_lib``, so :class:`EditableWheel` adds the file to the unpacked wheel directory. The file
  name sorts after ``__editable__.*`` (site reads ``.pth`` files in name order), so the editable
  finder that makes ``ztriton`` importable is in place before our line runs.
"""
from __future__ import annotations

import os
import shutil

from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ztriton-autoload.pth")


class BuildPy(build_py):
    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):
            self.copy_file(PTH, os.path.join(self.build_lib, os.path.basename(PTH)), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if getattr(self, "editable_mode", False):
            return outputs
        return [*outputs, os.path.join(self.build_lib, os.path.basename(PTH))]


class EditableWheel(editable_wheel):
    def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
        result = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
        shutil.copyfile(PTH, os.path.join(unpacked_wheel, os.path.basename(PTH)))
        return result
