"""llama.cpp's own tokenizer test suite: every vocabulary in its `models/ggml-vocab-*.gguf`.

Each `.gguf.inp` holds inputs separated by `__ggml_vocab_test__` lines and `.gguf.out` the expected ids (no BOS),
which llama.cpp's test-tokenizer-0 checks; here our tokenizer must give exactly those ids for every case of every
causal-LM vocabulary, decode back to the input, and stream through the incremental detokenizer without U+FFFD.
Vocabularies the suite ships without cases are checked against llama-cpp-python on every input of the suite.
Encoder vocabularies (BERT WordPiece, T5 Unigram) are not causal LMs: they must be refused with a clear error.

The suite comes from the sdist of the installed llama-cpp-python (`make fetch-vocab-suite`, part of `make test`);
without it these tests fail, they are never skipped."""

from __future__ import annotations

import functools
import glob
import os

import pytest

from shared.errors import GgufError
from shared.files.gguf_loader import GgufLoader
from shared.text.tokenizer import GgufTokenizer, IncrementalDetokenizer

pytestmark = pytest.mark.reference  # llama.cpp's own suite, from its sources (make fetch-vocab-suite), and its binding

SUITE = os.environ.get("STAGEMESH_VOCAB_SUITE", os.path.expanduser("~/.cache/stagemesh/llama.cpp-src"))
MODELS = os.path.join(SUITE, "models")
SEPARATOR = "\n__ggml_vocab_test__\n"

WITH_CASES = ["command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "gpt-2", "llama-bpe", "llama-spm",
              "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder"]
WITHOUT_CASES = ["aquila", "baichuan", "gpt-neox"]  # causal LMs the suite ships no .inp/.out for
ENCODERS = {"bert-bge": "bert", "nomic-bert-moe": "t5"}  # tokenizer.ggml.model of each; not causal LMs


def _path(name: str) -> str:
    path = os.path.join(MODELS, f"ggml-vocab-{name}.gguf")
    if not os.path.isfile(path):
        pytest.fail(f"llama.cpp's vocabulary suite is missing ({path}); run `make fetch-vocab-suite` (or set "
                    f"STAGEMESH_VOCAB_SUITE to a llama.cpp source tree)", pytrace=False)
    return path


def _read(path: str) -> str:
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()


@functools.cache
def cases(name: str) -> list[tuple[str, list[int]]]:
    """(input, expected ids) of one vocabulary, parsed as test-tokenizer-0 does."""
    path = _path(name)
    text, out = _read(path + ".inp"), _read(path + ".out")
    inputs = text.split(SEPARATOR)
    if text.endswith(SEPARATOR):
        inputs.pop()
    lines = out.split("\n")
    if out.endswith("\n"):
        lines.pop()
    assert len(inputs) == len(lines), f"{name}: {len(inputs)} inputs but {len(lines)} expected lines"
    return [(s, [int(t) for t in line.split()]) for s, line in zip(inputs, lines)]


@functools.cache
def tokenizer(name: str) -> GgufTokenizer:
    return GgufTokenizer.from_gguf(GgufLoader(_path(name)))


def test_the_suite_holds_exactly_the_vocabularies_this_test_knows():
    """A llama.cpp update that adds a vocabulary fails here until it is classified above."""
    _path("gpt-2")
    found = {os.path.basename(p)[len("ggml-vocab-"):-len(".gguf")] for p in glob.glob(os.path.join(MODELS, "*.gguf"))}
    assert found == set(WITH_CASES) | set(WITHOUT_CASES) | set(ENCODERS)
    with_cases = {n for n in found if os.path.isfile(os.path.join(MODELS, f"ggml-vocab-{n}.gguf.inp"))}
    assert with_cases == set(WITH_CASES) | {"bert-bge"}


@pytest.mark.parametrize("name", WITH_CASES)
def test_every_case_gives_llama_cpp_ids(name):
    tok = tokenizer(name)
    got = [(s, tok.encode(s, add_bos=False), ids) for s, ids in cases(name)]
    mismatches = [(s[:40], ours[:12], ids[:12]) for s, ours, ids in got if ours != ids]
    assert len(got) >= 46
    assert not mismatches, f"{len(mismatches)}/{len(got)} cases differ: {mismatches[:4]}"


@pytest.mark.parametrize("name", WITH_CASES)
def test_every_case_decodes_back(name):
    tok = tokenizer(name)
    bad = [(s[:40], tok.decode(ids)[:40]) for s, ids in cases(name) if tok.decode(ids) != s]
    assert not bad, bad[:4]


@pytest.mark.parametrize("name", WITH_CASES)
def test_incremental_detokenizer_streams_every_case_without_replacement_characters(name):
    tok = tokenizer(name)
    held_back = 0
    for s, ids in cases(name):
        detok = IncrementalDetokenizer(tok)
        deltas = [detok.push(i) for i in ids]
        held_back += sum(1 for d in deltas if d == "")
        deltas.append(detok.flush())
        assert all("\ufffd" not in d for d in deltas), (s[:40], deltas)
        assert "".join(deltas) == s, (s[:40], deltas)
    assert held_back > 0  # some token really ended inside a character (emoji, CJK) and waited for the next


@pytest.mark.parametrize("name", WITHOUT_CASES)
def test_vocabularies_without_cases_match_llama_cpp_python_on_every_suite_input(name):
    from services.testing.tiny_gguf import llama_cpp_vocab

    tok, ref = tokenizer(name), llama_cpp_vocab(_path(name))
    inputs = sorted({s for other in WITH_CASES for s, _ in cases(other)})
    mismatches = [s[:40] for s in inputs
                  if tok.encode(s, add_bos=False) != ref.tokenize(s.encode("utf-8"), add_bos=False, special=False)]
    assert len(inputs) >= 46
    assert not mismatches, f"{len(mismatches)}/{len(inputs)} inputs differ: {mismatches[:4]}"


@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_encoder_vocabularies_are_refused_with_a_clear_error(name):
    loader = GgufLoader(_path(name))
    assert loader.get("tokenizer.ggml.model") == ENCODERS[name]
    with pytest.raises(GgufError, match=f"tokenizer model '{ENCODERS[name]}' is not supported.*not causal"):
        GgufTokenizer.from_gguf(loader)
