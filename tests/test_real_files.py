"""Files as model hubs ship them, each against llama.cpp on the same file: llama.cpp's own quantizer presets (a
per-tensor mix of types; K-quant fallbacks where a row is not a multiple of 256) on tiny files of every architecture,
SmolLM2 requantized to the common presets, and the real Gemma 3 270M Q4_K_M file. The quantized files are built
once into services.testing.tiny_gguf.QUANT_CACHE; a preset llama.cpp refuses for a file is skipped with its reason."""

import math
import os

import numpy as np
import pytest
import torch

from services.testing.tiny_gguf import (
    PRESETS,
    PresetRefused,
    TinySpec,
    llama_cpp_logits,
    llama_cpp_model,
    quantize_preset,
    write_tiny_gguf,
)
from shared.files.gguf_loader import GgufLoader
from shared.files.layers import split_at
from shared.runtime.generation import split_windows, window_logits
from shared.runtime.model_files import ModelFiles
from shared.runtime.stage_runtime import LocalPipeline
from tests.test_architectures import ARCHS, _spec
from tests.test_tiny_models import IDS, _decode_logits

pytestmark = [pytest.mark.slow, pytest.mark.reference]  # minutes of llama.cpp comparisons: not in the fast tier

TOLERANCE = 1e-2  # max |diff| / logit range on the default path, as for the single-type files of test_quant_types
# the tiny gemma2's soft caps (1 on attention scores, 5 on logits: small so that they bite) amplify the bf16 path's
# rounding whatever the weights' type (its float32 path stays within 5e-4 of exact)
TOLERANCE_OF = {"gemma2": 2e-2}
# lean requantizes IQ types (and, where the integer-dot kernels do not run, 5-, 6-, 2- and 3-bit ones) to int8 rows:
# a per-row int8 step on top of the file's own
LEAN_TOLERANCE = 1.5e-2
# the tiny qwen3moe routes each token to its top 2 of 4 experts by random router weights: a token whose 2nd and 3rd
# experts nearly tie may route the other way under bf16 activations (its float32 path stays within 1e-3 of exact),
# which moves that one position's logits by the size of an expert's output; so one position of the window may
FLIPS_OF = {"qwen3moe": 1}  # differ by more than the tolerance, and only there (each position is still compared)
# llama at two widths: 576 (SmolLM2's: every K-quant falls back to Q5_0 / Q5_1 / Q8_0 / IQ4_NL on the 576-wide rows)
# and 256 (every row a whole superblock: the presets' own types throughout)
WIDTHS = {"w576": TinySpec(hidden=576, heads=9, kv_heads=3, head_dim=64, ffn=1536, weight_scale=0.03),
          "w256": TinySpec(hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=512, weight_scale=0.04)}
LEAN_BOUND = 1.5  # lean's weights per file byte, at most (the bound), on SmolLM2 requantized to:
LEAN_PRESETS = ("Q3_K_M", "Q4_0", "Q4_1", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")


def _preset(src: str, preset: str) -> str:
    try:
        return quantize_preset(src, preset)
    except PresetRefused as e:
        pytest.skip(str(e))


def write_sources(folder: str) -> dict[str, str]:
    """Float32 tiny GGUFs (the quantizer's input) written into folder: the llama widths and one per other
    architecture. The same bytes on every run (seeded), so their quantized files are found in QUANT_CACHE."""
    files = {name: write_tiny_gguf(os.path.join(folder, f"{name}.gguf"), spec) for name, spec in WIDTHS.items()}
    files |= {arch: write_tiny_gguf(os.path.join(folder, f"{arch}.gguf"), _spec(arch))
              for arch in ARCHS if arch != "llama"}
    return files


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    return write_sources(str(tmp_path_factory.mktemp("real-files")))


def _check_tiny(path: str, tolerance: float = TOLERANCE, flips: int = 0) -> None:
    """Three references, all llama.cpp's: its run of the file dequantized to F32 by its own quantizer (the file's
    numbers, computed exactly: our float32 must read every type to 1e-3 of it, and a float32 split must equal the
    unsplit run exactly); that same run for our default path (bf16, auto: each type's stored kernel for decode, the
    dense copy for a prefill) and lean, to `tolerance`; and its run of the quantized file itself, which computes with
    activations quantized to 8 bits -- our serving paths within `tolerance` plus that run's own distance from exact.
    flips: how many positions (of the 20) may exceed the tolerances on the bf16 paths (an MoE's routing flips)."""
    loader = GgufLoader(path)
    types = "/".join(sorted({loader.tensor_type(n) for n in loader.tensor_names if n.startswith("blk.")}))
    ref_quantized = llama_cpp_logits(llama_cpp_model(path, n_ctx=64), IDS)
    ref_exact = llama_cpp_logits(llama_cpp_model(_preset(path, "F32"), n_ctx=64), IDS)
    logit_range = ref_exact.max() - ref_exact.min()
    assert logit_range > 1.0  # the comparison is not vacuous
    llama_own = np.abs(ref_quantized - ref_exact).max() / logit_range

    def rel(ours, ref, skip: int = 0) -> float:  # the max over positions but the `skip` worst
        per_position = np.sort(np.abs(ours - ref).max(-1) / logit_range)
        return float(per_position[len(per_position) - 1 - skip])

    layers = int(loader.arch_get("block_count"))
    unsplit = window_logits(LocalPipeline.load(loader, None, torch.float32, kv_slots=1), IDS)
    split = window_logits(LocalPipeline.load(loader, split_at(layers, [layers // 2]), torch.float32, kv_slots=1), IDS)
    assert torch.equal(split, unsplit)
    print(f"\n{types}: float32 {rel(unsplit.double().numpy(), ref_exact):.1e} from exact; llama.cpp's own run of the "
          f"quantized file {llama_own:.1e}")
    assert rel(unsplit.double().numpy(), ref_exact) <= 1e-3
    for weights in (None, "lean"):
        pipeline = LocalPipeline.load(loader, None, torch.bfloat16, kv_slots=1, weights=weights)
        # where the integer-dot kernels run (AVX2 CPUs: Q4_0 / Q4_1 / Q8_0 matrices), activations are quantized to 8
        # bits as llama.cpp's own run quantizes them: that run's distance from exact is allowed on top
        own = llama_own if _quantizes_activations(pipeline) else 0.0
        for name, ours in (("prefill", window_logits(pipeline, IDS).double().numpy()),
                           ("decode", _decode_logits(pipeline, IDS))):
            bound = (max(tolerance, LEAN_TOLERANCE) if weights == "lean" else tolerance) + own
            print(f"  {weights or 'auto'} {name}: {rel(ours, ref_exact):.1e} from exact "
                  f"({rel(ours, ref_exact, flips):.1e} but {flips} positions), "
                  f"{rel(ours, ref_quantized):.1e} from llama.cpp's run of the quantized file")
            assert rel(ours, ref_exact, flips) <= bound, (weights, name)
            assert rel(ours, ref_quantized, flips) <= bound - own + llama_own, (weights, name)


def _same_kernels(a: LocalPipeline, b: LocalPipeline) -> bool:
    """Both pipelines hold every matrix the same way: the same kernel for each and the same bytes in all."""
    ma, mb = a.pieces[0].model, b.pieces[0].model
    return (len(a.pieces) == len(b.pieces) == 1 and ma.weight_summary() == mb.weight_summary()
            and ma.memory_report()["weight_bytes"] == mb.memory_report()["weight_bytes"])


def _quantizes_activations(pipeline: LocalPipeline) -> bool:
    """Some matrix of the pipeline runs on the integer-dot kernels (shared.kernels.qdot), which quantize activations."""
    return any("-dot-q8" in kind for piece in pipeline.pieces for kind in piece.model.weight_summary().values())


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("width", list(WIDTHS))
def test_every_preset_on_llama_matches_llama_cpp(sources, width, preset):
    _check_tiny(_preset(sources[width], preset))


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "llama"])
def test_every_preset_on_every_architecture_matches_llama_cpp(sources, arch, preset):
    _check_tiny(_preset(sources[arch], preset), TOLERANCE_OF.get(arch, TOLERANCE), FLIPS_OF.get(arch, 0))


def _perplexity(logits_of, windows: list[list[int]]) -> float:
    """Teacher-forced perplexity over the windows of logits_of(window) -> [T, V]. Each position's loss in float32
    (cross_entropy: max-shifted, ~1e-6 of a loss of ~3), their mean in float64; a log_softmax in float64 over 262k
    logits a position took a third of Gemma 3's test."""
    nll = []
    for w in windows:
        logits = torch.as_tensor(logits_of(w))[:-1].float()
        nll.append(torch.nn.functional.cross_entropy(logits, torch.tensor(w[1:]), reduction="none").double())
    return math.exp(torch.cat(nll).mean())


def _llama_cpp_perplexity(path: str, windows: list[list[int]]) -> float:
    llm = llama_cpp_model(path, n_ctx=max(len(w) for w in windows))
    return _perplexity(lambda w: llama_cpp_logits(llm, w), windows)


def _our_perplexities(path: str, windows: list[list[int]], modes: tuple[str, ...]) -> dict[str, tuple[float, LocalPipeline]]:
    """Our perplexity over the windows with each weights mode (bf16 activations, the default): {mode: (perplexity,
    its pipeline)}. Where lean holds every matrix as auto does (the same kernels and bytes: on AVX2 CPUs each type's
    integer-dot kernel in both), it computes the same numbers: that is checked on the first window, bit for bit, and
    auto's perplexity stands for both rather than computing it twice."""
    out: dict[str, tuple[float, LocalPipeline]] = {}
    for mode in modes:
        pipeline = LocalPipeline.load(GgufLoader(path), None, torch.bfloat16, kv_slots=1, weights=mode)
        same = next((p for p, other in out.values() if _same_kernels(other, pipeline)
                     and torch.equal(window_logits(other, windows[0]), window_logits(pipeline, windows[0]))), None)
        out[mode] = (same if same is not None else _perplexity(lambda w, p=pipeline: window_logits(p, w), windows),
                     pipeline)
    return out


@pytest.fixture(scope="module")
def windows(smollm2, varied_text) -> list[list[int]]:
    wins = split_windows(smollm2.tokenizer.encode(varied_text), 256)
    assert sum(len(w) - 1 for w in wins) >= 1000
    return wins


# The real file requantized to the presets hubs ship most (and IQ4_XS, the common IQ one). Every preset of PRESETS
# is held against llama.cpp on a file of SmolLM2's widths above (test_every_preset_on_llama_matches_llama_cpp, w576:
# the same K-quant fallbacks, logits to 1e-2; and at width 256, every row whole superblocks), and every tensor type of
# them alone against llama.cpp (tests/test_quant_types.py): the other 13 presets on the real file cost a quantization
# each on a fresh machine (~15 s for an IQ3 one) and would hold the same kernels to llama.cpp once more.
REAL_FILE_PRESETS = (*LEAN_PRESETS, "IQ4_XS")


@pytest.mark.parametrize("preset", REAL_FILE_PRESETS)
def test_smollm2_requantized_to_the_common_presets_matches_llama_cpp_perplexity(smollm2, windows, preset):
    """SmolLM2's Q4_1 file requantized by llama.cpp to each preset: our default path within 2 % of llama.cpp's
    perplexity on the same file (>= 1,000 tokens for the lean presets, ~500 for IQ4_XS); for the lean presets lean
    too, holding at most 1.5x the file's bytes (1 stage); a float32 split (3 pieces) equals the unsplit run. (Lean holds IQ types as int8 rows, 1 byte a weight against their 0.4-0.56: above 1.5x.)"""
    path = _preset(smollm2.loader.path, preset)
    if preset not in LEAN_PRESETS:  # on the first ~500 tokens, to keep the suite's time
        windows = windows[:2]
    ref = _llama_cpp_perplexity(path, windows)
    ours_by_mode = _our_perplexities(path, windows, ("auto", "lean") if preset in LEAN_PRESETS else ("auto",))
    for weights, (ours, _) in ours_by_mode.items():
        print(f"\nSmolLM2 {preset} {weights}: perplexity {ours:.4f}, llama.cpp {ref:.4f} ({ours / ref - 1:+.2%})")
        assert abs(ours / ref - 1) <= 0.02
    ids = windows[0][:96]  # and a float32 split equals the unsplit run exactly, on the requantized file too
    unsplit = window_logits(LocalPipeline.load(GgufLoader(path), None, torch.float32, kv_slots=1, max_seq_len=128), ids)
    ranges = split_at(GgufLoader(path).get("llama.block_count"), [11, 23])
    split = window_logits(LocalPipeline.load(GgufLoader(path), ranges, torch.float32, kv_slots=1, max_seq_len=128), ids)
    assert torch.equal(split, unsplit)
    if preset in LEAN_PRESETS:
        report = ours_by_mode["lean"][1].pieces[0].model.memory_report()
        print(f"SmolLM2 {preset} lean: {report['weight_bytes'] / 2**20:.1f} MiB = {report['weights_per_file_byte']}x "
              "the file")
        assert report["weights_per_file_byte"] <= LEAN_BOUND


@pytest.fixture(scope="module")
def gemma3() -> ModelFiles:
    return ModelFiles.open("gemma3-270m")


def test_real_gemma3_q4_k_m_matches_llama_cpp(gemma3, varied_text):
    """The real Gemma 3 270M Q4_K_M file (q/k/v of three types, Q6_K ffn_down, a Q8_0 tied 262k x 640 embedding):
    our default path and lean within 2 % of llama.cpp's perplexity on the same weights. llama.cpp computes a
    quantized file with its activations quantized to 8 bits; on this model that alone moves its perplexity by ~3 %,
    so the 2 % is held against llama.cpp on the file dequantized to F32 by llama.cpp's own quantizer (the same
    numbers, computed unquantized). Where our run is farther than that and quantizes activations too, llama.cpp's run
    of the quantized file (its own distance from exact) is allowed on top, and only then computed."""
    windows = split_windows(gemma3.tokenizer.encode(varied_text), 256)
    assert sum(len(w) - 1 for w in windows) >= 1000
    path = gemma3.loader.path
    ref_exact = _llama_cpp_perplexity(_preset(path, "F32"), windows)
    for weights, (ours, pipeline) in _our_perplexities(path, windows, ("auto", "lean")).items():
        print(f"\nGemma 3 270M Q4_K_M {weights}: perplexity {ours:.4f}, llama.cpp on its F32 dequantization "
              f"{ref_exact:.4f} ({ours / ref_exact - 1:+.2%})")
        if abs(ours / ref_exact - 1) <= 0.02:
            continue
        # the integer-dot kernels (AVX2 CPUs; here the Q8_0 embedding as lm_head) quantize activations as llama.cpp's
        # own run does: that run's distance from exact is allowed on top
        assert _quantizes_activations(pipeline), f"{weights}: {ours:.4f} against {ref_exact:.4f}"
        ref_file = _llama_cpp_perplexity(path, windows)
        print(f"  llama.cpp on the Q4_K_M file itself {ref_file:.4f} ({ref_file / ref_exact - 1:+.2%} from exact)")
        assert abs(ours / ref_exact - 1) <= 0.02 + abs(ref_file / ref_exact - 1)


def test_real_gemma3_split_equals_unsplit_in_float32(gemma3, varied_text):
    ids = gemma3.tokenizer.encode(varied_text)[:96]
    unsplit = window_logits(LocalPipeline.load(gemma3.loader, None, torch.float32, kv_slots=1, max_seq_len=128), ids)
    ranges = split_at(gemma3.config.num_layers, [7, 13])
    split = window_logits(LocalPipeline.load(gemma3.loader, ranges, torch.float32, kv_slots=1, max_seq_len=128), ids)
    assert torch.equal(split, unsplit)


def test_the_compiled_decode_step_covers_q8_0_blocks(smollm2):
    """SmolLM2 requantized to Q8_0 runs every block matmul as two int4 planes (in lean too; the Q5_* types' planes
    differ only in their zeros, fixed at load) -- or, where they run (AVX2 CPUs), on the integer-dot kernels
    (shared.kernels.qdot) -- which the compiled decode step covers: its inputs (the static-shape
    OneSequenceDecode attention over the context) through run_layers run as Python, as inductor traces it, give the
    eager decode step's logits, bit for bit with float32 activations (compiled, fused kernels round elsewhere), with
    the attention eager decode uses on this CPU (qdot's kernel on AVX2, else SDPA)."""
    from shared.batch.steps import Decode, Prefill
    from shared.models.compiled_decode import CompiledDecode, why_not_compilable
    from shared.runtime.stage_runtime import StageRuntime
    from shared.wire.protocol import SeqEntry

    loader = GgufLoader(_preset(smollm2.loader.path, "Q8_0"))
    runtime = StageRuntime.load(loader, None, torch.float32, kv_slots=2, max_seq_len=128, weights="lean")
    model = runtime.model
    assert why_not_compilable(model) is None
    from shared.models.linear import qdot_kind, qdot_takes

    assert {model.blocks[0].qkv.kind, model.blocks[0].gate_up.kind} == {
        qdot_kind("Q8_0") if qdot_takes("Q8_0") else "int4x2-g32"}
    runtime.kv = model.new_kv_cache(2, 128, scratch=True)
    step = CompiledDecode(model, runtime.kv)
    ids = IDS[:12]
    runtime.run([SeqEntry("s", Prefill(11, 0, 11, True))], token_ids=torch.tensor(ids[:11]))
    slot = runtime.kv._slot_of["s"]
    from shared.kernels import qdot

    def step_logits(kernel: bool) -> torch.Tensor:
        with torch.inference_mode():
            inputs = step._inputs(model.embed(torch.tensor(ids[11:12])), slot, 11)
            inputs[2].kernel = kernel  # the attention: torch's SDPA, or qdot's decode_attention (AVX2 CPUs)
            return model.lm_head(model.run_layers(*inputs))

    eager = runtime.run([SeqEntry("s", Decode(11))], token_ids=torch.tensor(ids[11:12]))
    assert eager.max() - eager.min() > 1.0
    # eager decode attends as the step does on this CPU: qdot's kernel where it runs (attention.KernelDecode), else SDPA
    assert torch.equal(step_logits(kernel=qdot.usable()), eager)
    if qdot.usable():
        # the kernel sums in its own order (tests/test_qdot.py: within 1e-5 of SDPA; here each layer's attention is
        # within ~7e-7), and the activations' 8-bit rounding in every matmul amplifies that: SDPA's own attention
        # perturbed by 3e-7 moved these logits by 0.45 (2026-11-27). Same prediction, logits within a few percent.
        sdpa = step_logits(kernel=False)
        assert sdpa.argmax() == eager.argmax()
        assert (sdpa - eager).abs().max() < 0.05 * (eager.max() - eager.min()), (sdpa - eager).abs().max()
