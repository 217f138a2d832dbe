"""Loading at size: a piece's memory is its weights. Each tensor is copied out of the file's map when its weight is
built and dropped after (shared.files.gguf_loader.PieceTensors), the map's pages are given back, a vocabulary-sized lm_head
becomes int8 rows a chunk at a time, and the heap's freed pages go back to the OS. Measured in a fresh process on a
llama.cpp-quantized Q4_K_M file with a real 128k vocabulary (Llama 3.2's shape, narrow)."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

from services.testing.shaped_gguf import SHAPES, write_shaped_f16
from services.testing.tiny_gguf import quantize_preset
from tests.conftest import uses_llama_cpp

MIB = 2**20

PROBE = r"""
import json, sys, torch
from shared.files.gguf_loader import GgufLoader
from shared.models import TransformerModel

def status():
    out = {}
    for line in open("/proc/self/status"):
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[key] = int(rest.split()[0]) * 1024
    return out

loader = GgufLoader(sys.argv[1])
before = status()
model = TransformerModel.from_gguf(loader, None, torch.bfloat16, weights="lean")
after = status()
print(json.dumps({"before": before, "after": after, "weights": model.weight_bytes(),
                  "file": model.memory.file_bytes,
                  "largest_tensor": max(loader.tensor_bytes([n]) for n in loader.tensor_names)}))
"""


@pytest.fixture(scope="module")
@uses_llama_cpp  # llama.cpp's quantizer makes the Q4_K_M file
def q4_k_m(tmp_path_factory) -> str:
    shape = dataclasses.replace(SHAPES["llama3.2-1b"], layers=6, hidden=1024, heads=16, kv_heads=4, head_dim=64,
                                ffn=4096)
    return quantize_preset(write_shaped_f16(str(tmp_path_factory.mktemp("load") / "f16.gguf"), shape, seed=5),
                           "Q4_K_M")


def test_a_lean_piece_holds_its_weights_not_the_file_besides(q4_k_m):
    out = subprocess.run([sys.executable, "-c", PROBE, q4_k_m], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    before, after, weights, file = m["before"], m["after"], m["weights"], m["file"]
    print(f"\nweights {weights / MIB:.0f} MiB of a {file / MIB:.0f} MiB file; anonymous +"
          f"{(after['RssAnon'] - before['RssAnon']) / MIB:.0f} MiB, file pages +"
          f"{(after['RssFile'] - before['RssFile']) / MIB:.0f} MiB, peak +{(after['VmHWM'] - before['VmRSS']) / MIB:.0f} MiB")
    assert weights > 100 * MIB  # big enough that a copy of the file, or of the lm_head in float32, would show
    # what the process keeps: the weights and a little of the heap, not the copies they were built from
    assert after["RssAnon"] - before["RssAnon"] <= 1.1 * weights + 48 * MIB
    # the file's pages read while loading are not held by the process (the page cache keeps them for the OS)
    assert after["RssFile"] - before["RssFile"] <= 0.1 * file + 16 * MIB
    # on the way: the weights and a copy of the few tensors being built from (PieceTensors.KEEP), the largest being
    # the 128k-row lm_head; no float32 copy of it (4 bytes a weight), no second copy of the share or of the layers
    largest = m["largest_tensor"]
    assert after["VmHWM"] - before["VmRSS"] <= 1.15 * weights + 2 * largest + 64 * MIB


CGROUP_V1 = "/sys/fs/cgroup/memory"


def _memory_cgroup(name: str, limit: int) -> str | None:
    """A cgroup v1 memory cgroup limited to `limit` bytes (None where this machine does not let us make one)."""
    path = f"{CGROUP_V1}/{name}"
    try:
        os.makedirs(path, exist_ok=True)
        with open(f"{path}/memory.limit_in_bytes", "w") as f:
            f.write(str(limit))
    except OSError:
        return None
    return path


def test_a_piece_that_cannot_fit_its_cgroup_is_refused_before_loading(q4_k_m):
    """A process confined to less memory than the piece's weights need (lean) says so at once, naming the layers
    and the sizes, instead of being killed by the OOM killer part way through loading."""
    cgroup = _memory_cgroup(f"stagemesh-test-{os.getpid()}", 4 * 2**30)
    if cgroup is None:
        pytest.skip(f"cannot make a memory cgroup under {CGROUP_V1} here")
    join = f"open({cgroup + '/cgroup.procs'!r}, 'w').write(str(__import__('os').getpid()))\n"
    try:
        # what a process that has imported torch and opened the file holds there, then a limit with room for that and
        # about half of the ~0.16 GiB of weights
        base = subprocess.run([sys.executable, "-c", join + "import torch, sys\nfrom shared.files.gguf_loader import GgufLoader\n"
                               "from shared.models.memory import cgroup_room\nGgufLoader(sys.argv[1])\n"
                               "print(4 * 2**30 - cgroup_room())", q4_k_m], capture_output=True, text=True, timeout=300)
        assert base.returncode == 0, base.stderr[-1500:]
        with open(f"{cgroup}/memory.limit_in_bytes", "w") as f:
            f.write(str(int(base.stdout.split()[-1]) + 90 * MIB))
        out = subprocess.run([sys.executable, "-c", join + PROBE, q4_k_m], capture_output=True, text=True, timeout=300)
    finally:
        os.rmdir(cgroup)
    assert out.returncode == 1, (out.returncode, out.stderr[-1500:])  # an error raised, not a kill (-9)
    assert re.search(r"DoesNotFit: layers 0:6 need 0\.1\d GiB", out.stderr) and "memory cgroup's limit" in out.stderr, \
        out.stderr[-1500:]
