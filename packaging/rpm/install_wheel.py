"""Install a wheel into a build root with Fedora's layout: macros.fallback's %pyproject_install.

Fedora's %pyproject_install runs pip; where its macros are missing (Debian), this does the same
for a pure-Python wheel with python3-installer: modules in <prefix>/lib/pythonX.Y/site-packages,
console scripts in <prefix>/bin with the system interpreter, INSTALLER "rpm", no
direct_url.json.
"""

from __future__ import annotations

import argparse
import sysconfig

# Debian's python3-installer, for /usr/bin/python3; the development venv does not have it.
from installer import install  # type: ignore[import-not-found]
from installer.destinations import SchemeDictionaryDestination  # type: ignore[import-not-found]
from installer.sources import WheelFile  # type: ignore[import-not-found]


def scheme(prefix: str) -> dict[str, str]:
    paths = sysconfig.get_paths("posix_prefix", vars={"base": prefix, "platbase": prefix,
                                                      "installed_base": prefix})
    return {"purelib": paths["purelib"], "platlib": paths["platlib"],
            "headers": paths["include"], "scripts": paths["scripts"], "data": paths["data"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", required=True, help="the build root (%%{buildroot})")
    parser.add_argument("--prefix", default="/usr")
    parser.add_argument("--interpreter", default="/usr/bin/python3")
    parser.add_argument("wheels", nargs="+")
    args = parser.parse_args()
    for wheel in args.wheels:
        destination = SchemeDictionaryDestination(
            scheme(args.prefix), interpreter=args.interpreter, script_kind="posix",
            destdir=args.root)
        with WheelFile.open(wheel) as source:
            install(source, destination, additional_metadata={"INSTALLER": b"rpm\n"})


if __name__ == "__main__":
    main()
