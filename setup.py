"""setuptools (metadata in setup.cfg), with one build step more.

The D-Bus interface definition dbus/org.gpuguard.GpuGuard1.xml is the only copy; gpuguardd
reads it as package data (gpuguardd/bus/contract.py). build_py copies it into the package it
builds, so every wheel carries it: pip's, pybuild's (the .deb), %pyproject_wheel's (the .rpm),
and one built from the sdist (MANIFEST.in puts dbus/ in that). A link in the source tree did
the same until a build from a release tarball copied regular files only and left it out.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

XML = Path("dbus") / "org.gpuguard.GpuGuard1.xml"
PACKAGE_DIR = Path("gpuguardd") / "bus"


class BuildPyWithInterface(build_py):
    def run(self) -> None:
        super().run()
        # An editable install builds nothing: the code reads dbus/ of the checkout.
        if not getattr(self, "editable_mode", False):
            target = Path(self.build_lib) / PACKAGE_DIR / XML.name
            self.mkpath(str(target.parent))
            self.copy_file(str(XML), str(target))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs: list[str] = super().get_outputs(include_bytecode)
        return [*outputs, str(Path(self.build_lib) / PACKAGE_DIR / XML.name)]


setup(cmdclass={"build_py": BuildPyWithInterface})
