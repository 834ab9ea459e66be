"""Build the GNOME Shell extension's two layouts from its one source.

GNOME Shell 45 changed how extensions load: ES modules (`import ... from 'gi://Gio'`, an
`export default class` extending Extension) where 43 and 44 use the legacy `imports` object
and an `init()` function. The source (src/) is written as ES modules; this script copies it
as is for 45 and later, and for 43/44 rewrites each import and export line into its legacy
form. The few shell APIs whose access differs live in compat45.js and compat43.js, one of
which becomes compat.js. Any other import or export line is an error here, so nothing can
slip through untranslated.

The display escaping is cockpit/src/escape.js, copied: one implementation of the CLI's rule
(gpuguardd/escaping.py) for both JavaScript front ends, held to tests/escaping_vectors.json.

    python3 gnome-shell-extension/build.py OUT [--pack]

makes OUT/43 and OUT/45 (installable directories named by the UUID inside), and with --pack
the zips extensions.gnome.org takes (`gnome-extensions pack`), OUT/<uuid>.shell-43.zip and
OUT/<uuid>.shell-45.zip.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
UUID = "gpuguard@gpuguard.org"
# Which GNOME Shell versions each layout declares (metadata.json's shell-version).
TARGETS = {"43": ["43", "44"], "45": ["45", "46", "47", "48"]}
COPIED = {
    "escape.js": ROOT / "cockpit/src/escape.js",
    "org.gpuguard.GpuGuard1.xml": ROOT / "dbus/org.gpuguard.GpuGuard1.xml",
    "stylesheet.css": HERE / "stylesheet.css",
}
_CURRENT = "imports.misc.extensionUtils.getCurrentExtension().imports"
_LEGACY: list[tuple[re.Pattern[str], Callable[[re.Match[str]], str]]] = [
    (re.compile(r"import (\w+) from 'gi://(\w+)(?:\?version=[\d.]+)?';"),
     lambda m: f"const {m[1]} = imports.gi.{m[2]};"),
    (re.compile(r"import \{([\w\s,]+)\} from '\./(\w+)\.js';"),
     lambda m: f"const {{{re.sub(r' as ', ': ', m[1])}}} = {_CURRENT}.{m[2]};"),
    (re.compile(r"import \* as (\w+) from '\./(\w+)\.js';"),
     lambda m: f"const {m[1]} = {_CURRENT}.{m[2]};"),
    # Legacy modules export their top-level `var`s and functions.
    (re.compile(r"export (?:default )?class (\w+)(.*)"), lambda m: f"var {m[1]} = class {m[1]}{m[2]}"),
    (re.compile(r"export function (.*)"), lambda m: f"function {m[1]}"),
    (re.compile(r"export (?:const|let) (.*)"), lambda m: f"var {m[1]}"),
]
_MODULE_LINE = re.compile(r"(import|export)\b")


class BuildError(Exception):
    pass


def legacy(name: str, text: str) -> str:
    """One ES module as a GNOME 43/44 legacy module."""
    out: list[str] = []
    entry = None
    for number, line in enumerate(text.splitlines(), start=1):
        if not _MODULE_LINE.match(line):
            out.append(line)
            continue
        for pattern, replace in _LEGACY:
            match = pattern.fullmatch(line)
            if match:
                out.append(replace(match))
                if line.startswith("export default class"):
                    entry = match[1]
                break
        else:
            raise BuildError(f"{name}:{number}: no GNOME 43 form for {line!r}")
    if entry is not None:
        # 43 calls init(metadata) and then enable()/disable() on what it returns.
        out += ["", "function init(metadata) {", f"    return new {entry}(metadata);", "}"]
    return "\n".join(out) + "\n"


def build(out: Path) -> dict[str, Path]:
    built: dict[str, Path] = {}
    sources = sorted(p for p in (HERE / "src").glob("*.js") if not p.name.startswith("compat"))
    for target, shells in TARGETS.items():
        directory = out / target / UUID
        if directory.exists():
            shutil.rmtree(directory)
        directory.mkdir(parents=True)
        files = {p.name: p.read_text() for p in sources}
        files["compat.js"] = (HERE / "src" / f"compat{target}.js").read_text()
        files["escape.js"] = COPIED["escape.js"].read_text()
        for name, text in files.items():
            legacy_text = legacy(name, text) if target == "43" and name != "compat.js" else text
            (directory / name).write_text(legacy_text)
        for name in ("org.gpuguard.GpuGuard1.xml", "stylesheet.css"):
            shutil.copyfile(COPIED[name], directory / name)
        metadata = json.loads((HERE / "metadata.json").read_text())
        metadata["shell-version"] = shells
        (directory / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
        built[target] = directory
    return built


def pack(built: dict[str, Path], out: Path) -> list[Path]:
    """The zips, by `gnome-extensions pack` (what extensions.gnome.org's upload expects)."""
    zips = []
    for target, directory in built.items():
        extra = sorted(p.name for p in directory.iterdir()
                       if p.name not in ("extension.js", "metadata.json", "stylesheet.css"))
        subprocess.run(["gnome-extensions", "pack", "--force", f"--out-dir={out}",
                        f"--podir={HERE / 'po'}", f"--gettext-domain={UUID_DOMAIN}",
                        *(f"--extra-source={name}" for name in extra), str(directory)],
                       check=True, capture_output=True, text=True)
        made = out / f"{UUID}.shell-extension.zip"
        final = out / f"{UUID}.shell-{target}.zip"
        made.replace(final)
        zips.append(final)
    return zips


UUID_DOMAIN = "gpuguard-shell-extension"


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__.strip().splitlines()[-5], file=sys.stderr)
        return 2
    out = Path(argv[0]).resolve()
    try:
        built = build(out)
        if "--pack" in argv[1:]:
            for zipped in pack(built, out):
                print(zipped)
    except (BuildError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or ""
        print(f"build.py: {exc} {detail}".strip(), file=sys.stderr)
        return 1
    for directory in built.values():
        print(directory)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
