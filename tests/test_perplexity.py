"""`stagemesh perplexity` follows llama.cpp's llama-perplexity (tools/perplexity/perplexity.cpp, `perplexity`, the
non-strided path; read at ggml-org/llama.cpp 050fc7f32de16858ac667d775b43a51ed8976e6f): its chunking and BOS rule as
a pure function, and its figure against that rule computed here from llama.cpp's own tokens and logits, on SmolLM2
(a vocabulary without BOS) and the real Gemma 3 270M file (BOS at the start of every chunk)."""

import json
import math
import subprocess

import numpy as np
import pytest

from services.testing.tiny_gguf import llama_cpp_logits, llama_cpp_model
from shared.errors import StagemeshError
from shared.runtime.generation import perplexity_chunks
from tests import test_real_files
from tests.conftest import stagemesh_cmd

B = 99  # a BOS id no token of the table uses


@pytest.mark.parametrize("n_tokens,context,bos_id,expected", [
    (8, 4, None, [[0, 1, 2, 3], [4, 5, 6, 7]]),  # exactly 2 x context: the least llama-perplexity takes
    (11, 4, None, [[0, 1, 2, 3], [4, 5, 6, 7]]),  # whole chunks only: the tail of 3 is dropped
    (8, 4, B, [[B, 1, 2, 3], [B, 5, 6, 7]]),  # BOS replaces each chunk's first token, it is not inserted
    (13, 3, B, [[B, 1, 2], [B, 4, 5], [B, 7, 8], [B, 10, 11]]),
    (6, 2, B, [[B, 1], [B, 3], [B, 5]]),
])
def test_chunks_follow_llama_perplexity(n_tokens, context, bos_id, expected):
    assert perplexity_chunks(list(range(n_tokens)), context, bos_id) == expected


@pytest.mark.parametrize("n_tokens,context,message", [
    (7, 4, "needs at least 2 x 4 = 8"),
    (300, 256, "lower --context to at most 150"),
    (10, 1, "at least 2 tokens"),
])
def test_too_few_tokens_say_how_many_are_needed(n_tokens, context, message):
    with pytest.raises(StagemeshError, match=message):
        perplexity_chunks(list(range(n_tokens)), context, None)


gemma3 = test_real_files.gemma3  # the real Gemma 3 270M file (--model gemma3-270m), as its tests there open it

CONTEXT = 128
TEXT_CHARS = 1700  # of tests/data/varied.txt: 3 chunks of 128 on both vocabularies (seconds of llama.cpp a chunk)


def _llama_cpp_chunk_logits(llm, text: str, n_ctx: int):
    """perplexity.cpp's chunks, on llama.cpp's own tokenization, with llama.cpp's logits [n_ctx, V] of each: the text
    tokenized once with add_special (common_tokenize(ctx, text, true): BOS first if the vocab adds it); n_chunk =
    tokens / n_ctx; chunk i is tokens[i*n_ctx, (i+1)*n_ctx) evaluated from an empty context, its first token replaced
    by BOS if the vocab adds BOS. -> [(the chunk's tokens of the text, logits)], whether the vocab adds BOS."""
    tokens = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
    add_bos = llm.tokenize(b"", add_bos=True, special=False) == [llm.token_bos()]  # llama_vocab_get_add_bos
    assert len(tokens) >= 2 * n_ctx
    out = []
    for i in range(len(tokens) // n_ctx):
        chunk = tokens[i * n_ctx:(i + 1) * n_ctx]
        batch = [llm.token_bos(), *chunk[1:]] if add_bos else chunk
        out.append((chunk, llama_cpp_logits(llm, batch)))
    return out, add_bos


def _nll_mean(chunk_logits, first: int) -> float:
    """process_logits: the mean over chunks of -log softmax(logits[j])[chunk[j + 1]] for j = first .. n_ctx-2
    (llama-perplexity: first = n_ctx/2; the old rule: first = 0)."""
    nll = []
    for chunk, logits in chunk_logits:
        rows = logits[first:-1]
        top = rows.max(-1, keepdims=True)
        logp = rows - top - np.log(np.exp(rows - top).sum(-1, keepdims=True))
        nll.append(-logp[np.arange(len(rows)), chunk[first + 1:]])
    return float(np.concatenate(nll).mean())


def _stagemesh_perplexity(model: str, path: str, *flags: str) -> dict:
    proc = subprocess.run(stagemesh_cmd("perplexity", "--model", model, "--file", path, "--context", str(CONTEXT),
                                        "--dtype", "float32", "--json", *flags), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def text_file(varied_text, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("perplexity") / "text.txt"
    path.write_text(varied_text[:TEXT_CHARS], encoding="utf-8")
    return str(path)


def _check_agreement(name: str, model: str, llm, path: str, *flags: str) -> tuple[list, bool]:
    """stagemesh perplexity --json [flags] within 1 % of the llama-perplexity figure from llm's tokens and logits, on
    as many chunks and scored tokens."""
    chunk_logits, add_bos = _llama_cpp_chunk_logits(llm, open(path, encoding="utf-8").read(), CONTEXT)
    ref = math.exp(_nll_mean(chunk_logits, CONTEXT // 2))
    ours = _stagemesh_perplexity(model, path, *flags)
    print(f"\n{name} (add_bos {add_bos}): stagemesh perplexity {ours['perplexity']:.4f}, llama-perplexity's rule on "
          f"llama.cpp's logits {ref:.4f} ({ours['perplexity'] / ref - 1:+.2%}), {ours['chunks']} chunks of {CONTEXT}")
    assert ours["chunks"] == len(chunk_logits) >= 3
    assert ours["scored_tokens"] == len(chunk_logits) * (CONTEXT - 1 - CONTEXT // 2)
    assert abs(ours["perplexity"] / ref - 1) <= 0.01
    return chunk_logits, add_bos


@pytest.mark.slow
@pytest.mark.processes
def test_smollm2_agrees_with_llama_perplexity(smollm2, llama_ref, text_file):
    """SmolLM2's vocabulary adds no BOS: no replacement, only the chunking and the second-half scoring. Against
    llama.cpp on the same Q4_1 file (its 8-bit activations move this model's figure by ~0.3 %), with the K/V cache in
    the same dtype on both sides: float32 (-ctk f32 -ctv f32), and float16 (--kv-dtype float16 against llama.cpp's
    default cache, llama_ref's)."""
    f32 = llama_cpp_model(smollm2.loader.path, n_ctx=CONTEXT, kv_dtype="float32")
    _, add_bos = _check_agreement("SmolLM2", "smollm2", f32, text_file)
    assert not add_bos
    _check_agreement("SmolLM2, K/V in float16", "smollm2", llama_ref, text_file, "--kv-dtype", "float16")


@pytest.mark.slow
@pytest.mark.processes
def test_gemma3_agrees_with_llama_perplexity_and_bos_per_chunk_matters(gemma3, text_file):
    """The real Gemma 3 270M file, whose vocabulary adds BOS: every chunk starts with BOS. Against llama.cpp on the
    file dequantized to F32 by its own quantizer (the same weights computed exactly: llama.cpp's run of the Q4_K_M
    file quantizes activations to 8 bits, which alone moves this model's figure by ~1-3 %; see tests/test_real_files.py). Without BOS at the start
    of each chunk -- the old rule's windows -- the same logits read much higher."""
    llm = llama_cpp_model(test_real_files._preset(gemma3.loader.path, "F32"), n_ctx=CONTEXT)
    new, add_bos = _check_agreement("Gemma 3 270M", "gemma3-270m", llm, text_file)
    assert add_bos
    # the old rule's windows: the same chunks as the text has them, BOS only at the start of the first (as here)
    assert new[0][0][0] == llm.token_bos() != new[1][0][0]
    old = new[:1] + [(chunk, llama_cpp_logits(llm, chunk)) for chunk, _ in new[1:]]
    no_bos = math.exp(_nll_mean(old, CONTEXT // 2))  # the same chunks and scored tokens, BOS only at the start
    old_rule = math.exp(_nll_mean(old, 0))  # and every token of each window scored: the old stagemesh figure
    with_bos = math.exp(_nll_mean(new, CONTEXT // 2))
    print(f"Gemma 3 on llama.cpp's logits: BOS per chunk {with_bos:.4f}; BOS only at the start {no_bos:.4f} "
          f"(second halves), {old_rule:.4f} (every token: the old rule)")
    assert no_bos > 1.2 * with_bos
