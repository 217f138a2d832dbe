"""Architectures through real stage processes: a 2-stage mesh on loopback generates what one process does. Every
architecture's split is exact in process (tests/test_architectures.py, the pieces a stage process runs: the same
code); here the three that differ most in what a stage does. (A module of its own: the suite runs the modules that
start processes beside those that start none, tests/conftest.py's suite_part.)"""

import pytest
import torch

from services.testing.tiny_gguf import write_tiny_gguf
from shared.files.gguf_loader import GgufLoader
from shared.runtime.stage_runtime import LocalPipeline
from tests.test_architectures import _spec
from tests.test_tiny_models import IDS


@pytest.mark.processes
# An MoE with q/k norms, parallel blocks with LayerNorm and a partial rope, and sliding windows with soft caps and a
# tied head.
@pytest.mark.parametrize("arch", ["qwen3moe", "phi2", "gemma2"])
async def test_two_stage_mesh_generates_what_one_process_does(arch, tmp_path):
    """Real stage processes on loopback (float32): greedy tokens through 2 stages == one local process."""
    from services.process.launch import start_mesh
    from shared.batch.sampling import SamplingParams
    from shared.runtime.generation import generate_tokens
    from tests.mesh import generate_group

    path = write_tiny_gguf(str(tmp_path / f"{arch}.gguf"), _spec(arch))
    local = LocalPipeline.load(GgufLoader(path), None, torch.float32, kv_slots=1)
    expected = list(generate_tokens(local, IDS, SamplingParams(), 8))
    mesh = start_mesh(path, 2, dtype="float32", log_dir=str(tmp_path))
    try:
        client = mesh.client()
        await client.start()
        try:
            out = await generate_group(client, {"s": IDS}, 8)
        finally:
            await client.close()
    finally:
        mesh.stop()
    assert len(expected) == 8 and out["s"] == expected
