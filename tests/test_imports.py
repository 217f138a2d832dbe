"""The layering of services/ and shared/, stated as import-linter contracts in pyproject.toml: a module imports only
from the layers below its own, and no package's modules import each other in a cycle (imports inside functions
count, and so do those under `if TYPE_CHECKING:`). The contracts are checked on the tree as it is, and shown to
catch upward imports planted in one copy of it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = str(Path(sys.executable).with_name("lint-imports"))


def lint(tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run([LINT, "--no-cache"], cwd=tree, capture_output=True, text=True, timeout=300)


def test_the_tree_keeps_its_layers():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout and f"{len(contracts)} kept" in result.stdout, result.stdout[-2000:]


# (module, line appended, the chain the broken contract names): each breaks a different contract, so all are planted in
# one copy of the tree and checked by one lint-imports run, each case reading its own chain in the report
PLANTED = {
    "type-over-runtime": ("shared/batch/steps.py", "import shared.runtime.stage_runtime",
                          "shared.batch.steps -> shared.runtime.stage_runtime"),
    "kernel-over-model": ("shared/kernels/qdot.py", "from shared.models import transformer",
                          "shared.kernels.qdot -> shared.models.transformer"),
    "engine-over-frontend": ("services/gateway/engine/scheduler.py", "from services.gateway.frontend import events",
                             "services.gateway.engine.scheduler -> services.gateway.frontend.events"),
    # a type-checking import is an edge too (exclude_type_checking_imports = false)
    "frontend-over-api": ("services/gateway/frontend/durable.py",
                          "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from services.gateway.api import openai",
                          "services.gateway.frontend.durable -> services.gateway.api.openai"),
    "function-level": ("shared/errors.py", "def _late():\n    import shared.cpu", "shared.errors -> shared.cpu"),
}


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> subprocess.CompletedProcess:
    """lint-imports on one copy of the tree with every PLANTED import appended."""
    tree = tmp_path_factory.mktemp("tree")
    for part in ("services", "shared", "pyproject.toml"):
        src = ROOT / part
        if src.is_dir():
            shutil.copytree(src, tree / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, tree / part)
    for module, line, _ in PLANTED.values():
        with open(tree / module, "a") as f:
            f.write(f"\n{line}\n")
    return lint(tree)


@pytest.mark.parametrize("case", PLANTED)
def test_an_upward_import_breaks_a_contract(planted, case):
    _, _, says = PLANTED[case]
    assert planted.returncode != 0 and "BROKEN" in planted.stdout, planted.stdout[-2000:]
    assert says in planted.stdout, f"{case}: no broken contract names {says!r}\n{planted.stdout[-3000:]}"
