"""`make lint` enforces the layers of pyproject.toml's [tool.importlinter]: a wrong import fails it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["vgpu", "nodecore", "runtime_hook", "device_plugin", "dra_plugin", "monitor", "vgpu_scheduler"]
PACKAGES += ["node_setup", "vgpuctl", "sim", "tests"]
LINT = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.timeout(300)


def _tree(tmp: Path) -> Path:
    """The project's Python packages and config, copied (sources only)."""
    dst = tmp / "tree"
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "data", "build")
    for p in PACKAGES:
        shutil.copytree(ROOT / p, dst / p, ignore=ignore)
    shutil.copytree(ROOT / "packaging" / "demo", dst / "packaging" / "demo", ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", dst)
    return dst


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{tree}:{tree / 'packaging' / 'demo'}"}
    return subprocess.run(
        [str(LINT), "--no-cache"], cwd=tree, env=env, capture_output=True, text=True, timeout=240, check=False
    )


def _add_import(path: Path, line: str) -> None:
    path.write_text(path.read_text() + f"\n{line}  # a wrong import, added by the test\n")


@pytest.mark.parametrize(
    ("where", "line"),
    [
        ("vgpu/paths.py", "import nodecore.core"),  # the contracts import nothing of ours
        ("nodecore/records.py", "import device_plugin.server"),  # the node core sits below the front ends
        ("dra_plugin/slices.py", "import device_plugin.inventory"),  # front ends are peers
        ("monitor/procs.py", "import runtime_hook.oci"),  # daemons are peers
        ("vgpu_scheduler/fit.py", "import sim.kubeapi"),  # shipped code never imports the simulators
        ("node_setup/files.py", "import tests.support.traces"),  # nor the tests
    ],
)
def test_a_wrong_import_breaks_lint(tmp_path: Path, where: str, line: str) -> None:
    tree = _tree(tmp_path)
    _add_import(tree / where, line)
    r = _lint(tree)
    assert r.returncode != 0, r.stdout
    assert "BROKEN" in r.stdout and line.split()[1].split(".")[0] in r.stdout, r.stdout[-3000:]


def test_the_tree_as_it_is_keeps_every_contract(tmp_path: Path) -> None:
    r = _lint(_tree(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:]
    assert "0 broken" in r.stdout
