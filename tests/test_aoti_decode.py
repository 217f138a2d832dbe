"""The one-sequence decode step as a saved AOTInductor package (shared.models.aoti_decode): built once and saved,
loaded by a later process instead of compiled, the same tokens either way; a broken file is built again.

The suite turns packages off (tests/conftest.py: STAGEMESH_AOTI_CACHE=off); these tests give each CompiledDecode a
folder of their own. The batched graph (torch.compile, unchanged) is left out: it is tested elsewhere and would add
minutes of compiling."""

import json
import os
import subprocess
import sys

import pytest
import torch

from services.testing.tiny_gguf import TinySpec, write_tiny_gguf

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = [1, 504, 2365, 282, 260, 5549, 2799]  # any tokens: a short prompt
STEPS = 8


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def piece(model_name: str):
    """The model file, its whole model in float32 and the KV cache decode() runs it with (3 slots of 256)."""
    from shared.runtime.model_files import ModelFiles
    from shared.runtime.stage_runtime import StageRuntime

    files = ModelFiles.open(model_name)
    model = StageRuntime.load(files.loader, None, torch.float32, kv_slots=3, max_seq_len=256,
                              compile_decode="off").model
    return files, model, model.new_kv_cache(3, 256, scratch=True)


def package_file(folder: str, model_name: str) -> str:
    """Where decode(folder, model_name) looks for its saved step and saves it."""
    from shared.models.aoti_decode import package_key, package_path

    files, model, kv = piece(model_name)
    return package_path(folder, package_key(model, kv, torch.get_num_threads(), files.loader.fingerprint))


def decode(package_dir: str | None, model_name: str = "smollm2") -> dict:
    """SmolLM2 (the default model; or `model_name`, a name or GGUF path; float32, 2 threads' worth of this machine)
    with a CompiledDecode whose packages live in package_dir (None: eager), warmed up as `--compile-decode on` does;
    STEPS greedy decode steps after PROMPT. Returns the tokens, the step's info, the seconds and resident memory the one-sequence step's warm-up
    took (torch._inductor imported before, as a stage that compiles has), and the weights' bytes."""
    import torch._inductor  # noqa: F401  (its import is not the package's memory)

    from shared.batch.steps import Decode, Prefill
    from shared.models.compiled_decode import CompiledDecode
    from shared.runtime.stage_runtime import StageRuntime
    from shared.wire.protocol import SeqEntry

    files, model, kv = piece(model_name)
    info, seconds, grew = None, None, None
    if package_dir is not None:
        compiled = CompiledDecode(model, kv, fingerprint=files.loader.fingerprint, package_dir=package_dir)
        compiled._batched, compiled.batch_reason = None, "left out by the test"
        before = rss_mib()
        compiled.warm_up()
        grew = rss_mib() - before
        info = compiled.info()
        seconds = info["one_sequence"]["seconds"]
        rt = StageRuntime(model, kv, compiled)
    else:
        rt = StageRuntime(model, kv)
    logits = rt.run([SeqEntry("s", Prefill(len(PROMPT), 0, len(PROMPT), True))], token_ids=torch.tensor(PROMPT))
    tokens = [int(logits[-1].argmax())]
    for k in range(STEPS):
        logits = rt.run([SeqEntry("s", Decode(len(PROMPT) + k))], token_ids=torch.tensor(tokens[-1:]))
        tokens.append(int(logits[-1].argmax()))
    weights = sum(p.nbytes for p in getattr(rt.compiled, "_packaged", {}).get(torch.get_num_threads(), None).weights) \
        if info and info["one_sequence"]["path"] != "torch.compile" else 0
    return {"tokens": tokens, "info": info, "seconds": seconds, "rss_grew_mib": grew, "weights_bytes": weights,
            "steps": rt.compiled.steps if info else 0}


def child() -> None:
    """decode() in a fresh process: the package folder and the model from argv, one JSON line out."""
    print(json.dumps(decode(sys.argv[1], sys.argv[2])))


# SmolLM2's widths, vocabulary and Q4_1 blocks in 4 layers of seeded weights (its 30 took ~50 s to build, ~100 s
# beside the rest of the suite; what is proven does not depend on the depth): weights of tens of MiB, so that a
# package of code and a load that shares them stand out from them
SMOLLM2_WIDE = TinySpec(hidden=576, heads=9, kv_heads=3, head_dim=64, ffn=1536, layers=4, quant="Q4_1",
                        weight_scale=0.03)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    model = write_tiny_gguf(str(tmp_path_factory.mktemp("aoti-model") / "wide.gguf"), SMOLLM2_WIDE)
    folder = str(tmp_path_factory.mktemp("aoti"))
    eager = decode(None, model)
    first = decode(folder, model)
    return folder, eager, first, model


def test_the_step_is_built_saved_and_decodes_as_eager(built):
    folder, eager, first, _ = built
    one = first["info"]["one_sequence"]
    assert one["path"] == "aoti-compiled" and one["ready"] and one["package_reason"] is None, first["info"]
    assert first["info"]["compile_seconds"] == {}  # no torch.compile graph
    saved = [f for f in os.listdir(folder) if f.endswith(".pt2")]
    assert len(saved) == 1 and one["packages"] == [os.path.join(folder, saved[0])]
    # code, not weights: the model's stacked weights are inputs of the package, not copied into it
    assert os.path.getsize(one["packages"][0]) < first["weights_bytes"] / 4
    assert first["steps"] == STEPS  # every decode step ran the package
    assert first["tokens"] == eager["tokens"]


@pytest.mark.processes
@pytest.mark.cpu_bound  # the new process loads and decodes, nothing else: the module runs beside the process tests
def test_a_new_process_loads_the_package_instead_of_compiling(built):
    folder, eager, first, model = built
    p = subprocess.run([sys.executable, "-c", "from tests.test_aoti_decode import child; child()", folder, model],
                       cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr[-3000:]
    second = json.loads(p.stdout.strip().splitlines()[-1])
    one = second["info"]["one_sequence"]
    assert one["path"] == "aoti-loaded", second["info"]
    threads = str(torch.get_num_threads())
    assert one["seconds"][threads] < first["info"]["one_sequence"]["seconds"][threads], (one, first["info"])
    assert second["tokens"] == first["tokens"]
    # loading shares the model's weights: resident memory grows by less than they take (a copy would grow by them
    # and the package's code, ~30 MiB here, besides)
    assert second["rss_grew_mib"] * 2**20 < second["weights_bytes"], second


def test_a_broken_package_is_built_again(built, tiny_path, tmp_path, caplog):
    """A partial package (the first half of a copy of `built`'s) where the tiny llama's step is looked for
    (tests/conftest.py tiny_path, 2 layers) is found unusable, built again at that path, and decodes as the eager
    step. What is proven does not depend on the model's size: one tiny build takes ~10 s."""
    folder = str(tmp_path)
    path = package_file(folder, tiny_path)
    with open(built[2]["info"]["one_sequence"]["packages"][0], "rb") as f:
        whole = f.read()
    with open(path, "wb") as f:  # a partial file: the first half of one
        f.write(whole[:len(whole) // 2])
    eager, again = decode(None, tiny_path), decode(folder, tiny_path)
    one = again["info"]["one_sequence"]
    assert one["path"] == "aoti-compiled" and one["packages"] == [path], again["info"]
    assert "unusable" in caplog.text
    assert again["tokens"] == eager["tokens"]
    assert os.path.getsize(path) > 0 and not [f for f in os.listdir(folder) if f.startswith(".building-")]
