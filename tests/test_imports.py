"""The layering of services/ and shared/, stated as import-linter contracts in pyproject.toml: a module imports only
from the layers below its own, and no package's modules import each other in a cycle (imports inside functions
count; those under `if TYPE_CHECKING:` never run and do not). The contracts are checked on the tree as it is, and
shown to catch an upward import and a cycle planted in a copy of it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = str(Path(sys.executable).with_name("lint-imports"))


def lint(tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run([LINT, "--no-cache"], cwd=tree, capture_output=True, text=True, timeout=300)


def test_the_tree_keeps_its_layers():
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout and "11 kept" in result.stdout, result.stdout[-2000:]


@pytest.mark.parametrize("module, line, says", [
    ("shared/batch/steps.py", "import shared.runtime.stage_runtime", "shared.batch.steps -> shared.runtime.stage_runtime"),  # a type importing the runtime
    ("shared/kernels/qdot.py", "from shared.models import transformer", "shared.kernels.qdot -> shared.models.transformer"),
    ("services/gateway/engine/scheduler.py", "from services.gateway import engine", "services.gateway.engine.scheduler -> "),
    ("shared/errors.py", "def _late():\n    import shared.cpu", "shared.errors -> shared.cpu"),  # inside a function
], ids=["type-over-runtime", "kernel-over-model", "policy-over-engine", "function-level"])
def test_an_upward_import_breaks_a_contract(tmp_path, module, line, says):
    for part in ("services", "shared", "pyproject.toml"):
        src = ROOT / part
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / part)
    with open(tmp_path / module, "a") as f:
        f.write(f"\n{line}\n")
    result = lint(tmp_path)
    assert result.returncode != 0 and "BROKEN" in result.stdout and says in result.stdout, result.stdout[-2000:]
