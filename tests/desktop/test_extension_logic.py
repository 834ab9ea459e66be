"""The extension's pure logic under the two JavaScript engines it meets: gjs (GNOME Shell's,
here 1.74 of GNOME 43) and node, on the GNOME 45 layout build.py makes (ES modules).

* Display escaping: the extension ships cockpit/src/escape.js, the CLI's rule
  (gpuguardd/escaping.py), held to every entry of tests/escaping_vectors.json here too, in
  gjs's regular expressions (SpiderMonkey's Unicode tables), not only node's.
* The worst state, the holder order (the user's own first) and line (escaped), the
  notifications' filters.
* build.py: both layouts from one source, the 43 one with no ES module syntax left, the 45
  one parsed by node as a module; an import it cannot translate is an error.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.desktop.shell_harness import ROOT, UUID

VECTORS = json.loads((ROOT / "tests/escaping_vectors.json").read_text())["vectors"]
HOLDERS = [
    {"pid": 10, "uid": 0, "comm": "other", "gpu_memory": 5 << 30, "unit": "a.service"},
    {"pid": 11, "uid": 1000, "comm": "mine\u202egnp", "gpu_memory": 1 << 30, "container": "docker/ab"},
    {"pid": 12, "uid": 0, "comm": "big", "gpu_memory": 9 << 30, "unit": ""},
]
RUNNER = """import {escapeText} from './escape.js';
import {endedOf, format, gpuTitle, holderLine, sortHolders, sweepLeftBehind, worstState} from './state.js';

const vectors = %(vectors)s;
const holders = %(holders)s;
const known = new Map(holders.map(h => [h.pid, h]));
const result = {
    escaped: vectors.map(v => escapeText(v.input)),
    worst: [
        worstState(['idle', 'in-use'], false, true),
        worstState(['idle', 'suspended'], false, true),
        worstState(['suspended'], false, true),
        worstState(['in-use'], true, true),
        worstState(['leaked', 'idle'], true, true),
        worstState(['lost', 'leaked'], false, true),
        worstState(['a-state-from-the-future', 'leaked'], false, true),
        worstState(['idle'], false, false),
        worstState([], false, true),
    ],
    order: sortHolders(holders, 1000).map(h => h.pid),
    lines: sortHolders(holders, 1000).map(holderLine),
    left: ['freed', 'survivors', 'memory-not-released', 'unverified'].map(o => sweepLeftBehind({outcome: o})),
    ended: endedOf({terminated: [{pid: 11, comm: 'mine\u202egnp'}, {pid: 10, comm: 'other'}, {pid: 99},
                                 {pid: 12, comm: 'reused'}]}, known, 1000).map(t => t.pid),
    endedByUid: endedOf({terminated: [{pid: 11, comm: 'mine\u202egnp', uid: 0},
                                      {pid: 50, comm: 'fast', uid: 1000}]}, known, 1000).map(t => t.pid),
    format: format('GPU %%d: %%s, 100%%%%', 3.7, 'x'),
    titles: [
        gpuTitle({vendor: 'nvidia', name: 'NVIDIA H100 80GB HBM3'}),
        gpuTitle({vendor: 'amd', name: 'AMD Instinct MI300X'}),
        gpuTitle({vendor: 'amd', name: ''}),
        gpuTitle({vendor: 'x\u202e', name: 'evil\\n\\u001b[2J'}),
    ],
};
const text = JSON.stringify(result);
if (typeof print === 'function')
    print(text);
else
    console.log(text);
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("layouts")
    subprocess.run([sys.executable, str(ROOT / "gnome-shell-extension/build.py"), str(out)],
                   check=True, capture_output=True)
    return out


def run_under(engine: str, built: Path, tmp_path: Path) -> dict[str, Any]:
    if shutil.which(engine) is None:
        pytest.fail(f"{engine} is required (make deps installs gnome-shell, which brings gjs, and nodejs)")
    work = tmp_path / engine
    shutil.copytree(built / "45" / UUID, work)
    (work / "package.json").write_text('{"type": "module"}\n')  # node: .js files are modules
    (work / "runner.js").write_text(RUNNER % {"vectors": json.dumps(VECTORS),
                                              "holders": json.dumps(HOLDERS)})
    argv = ["gjs", "-m", "runner.js"] if engine == "gjs" else ["node", "runner.js"]
    result = subprocess.run(argv, cwd=work, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    data: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return data


@pytest.mark.parametrize("engine", ["gjs", "node"])
def test_logic_under_each_engine(engine: str, built: Path, tmp_path: Path) -> None:
    got = run_under(engine, built, tmp_path)
    for vector, escaped in zip(VECTORS, got["escaped"]):
        assert escaped == vector["expected"], f"{engine}: vector {vector['name']!r}"
    assert got["worst"] == ["in-use", "idle", "suspended", "sweeping", "leaked", "lost",
                            "a-state-from-the-future", "absent", "idle"]
    assert got["order"] == [11, 12, 10]
    assert got["lines"][0] == "mine\\u202egnp (11) · docker/ab · 1.0 GiB"
    assert got["lines"][1] == "big (12) · 9.0 GiB"
    assert got["left"] == [False, True, True, False]
    assert got["ended"] == [11]
    assert got["endedByUid"] == [50]
    assert got["format"] == "GPU 3: x, 100%"
    # The menu's GPU lines and leak notifications name vendor and product, escaped.
    assert got["titles"] == ["nvidia NVIDIA H100 80GB HBM3", "amd AMD Instinct MI300X", "amd",
                             "x\\u202e evil\\n\\x1b[2J"]


def test_the_43_layout_is_legacy_and_the_45_one_a_module(built: Path) -> None:
    legacy = built / "43" / UUID
    modern = built / "45" / UUID
    assert sorted(p.name for p in legacy.iterdir()) == sorted(p.name for p in modern.iterdir())
    for path in legacy.glob("*.js"):
        for line in path.read_text().splitlines():
            assert not line.startswith(("import ", "export ")), f"{path.name}: {line}"
    assert "function init(metadata)" in (legacy / "extension.js").read_text()
    assert json.loads((legacy / "metadata.json").read_text())["shell-version"] == ["43", "44"]
    assert "45" in json.loads((modern / "metadata.json").read_text())["shell-version"]
    for path in modern.glob("*.js"):
        module = path.with_suffix(".mjs")
        shutil.copyfile(path, module)
        check = subprocess.run(["node", "--check", str(module)], capture_output=True, text=True,
                               check=False)
        module.unlink()
        assert check.returncode == 0, f"{path.name}: {check.stderr}"


def test_an_untranslatable_line_is_an_error() -> None:
    # By path: the name `build` is also PyPI's build package.
    spec = importlib.util.spec_from_file_location("extension_build", ROOT / "gnome-shell-extension/build.py")
    assert spec is not None and spec.loader is not None
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    with pytest.raises(build.BuildError, match=r"x\.js:2"):
        build.legacy("x.js", "// fine\nimport Foo from 'resource:///org/gnome/shell/ui/main.js';\n")
    assert build.legacy("y.js", "export const A = 1;\n") == "var A = 1;\n"
