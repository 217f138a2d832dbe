import os
import sys

import pytest
import torch

from shared.model_files import ModelFiles

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")


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
