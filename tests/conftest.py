import os
import sys

import pytest
import torch

from shared.model_files import ModelFiles

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")

# Stages the suite starts (dozens of them, each a real process) decode eagerly unless a test asks otherwise: with the
# serving default (auto) each would spend a minute of both cores compiling in the background. The compiled step is
# tested where it is the point: tests/test_numerics.py (in process) and tests/test_compiled_mesh.py (real stages).
os.environ["STAGEMESH_COMPILE_DECODE"] = "off"


@pytest.fixture(scope="session")
def smollm2() -> ModelFiles:
    return ModelFiles.open("smollm2")


@pytest.fixture(scope="session")
def llama_ref(smollm2):
    from tests.factories import llama_cpp_model

    return llama_cpp_model(smollm2.loader.path, n_ctx=256)


@pytest.fixture(scope="session")
def varied_text() -> str:
    with open(os.path.join(DATA, "varied.txt"), encoding="utf-8") as f:
        return f.read()


@pytest.fixture(scope="session")
def output_dir() -> str:
    path = os.path.join(ROOT, "test-output")
    os.makedirs(path, exist_ok=True)
    return path


def stagemesh_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


torch.set_num_threads(max(1, os.cpu_count() or 1))
