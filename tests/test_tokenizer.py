"""Tokenizer parity with llama.cpp (llama-cpp-python's tokenize) on the SmolLM2 file."""

import pytest

from shared.text.tokenizer import IncrementalDetokenizer

STRINGS = [
    "Hello world", "Hello, world!", "The quick brown fox jumps over the lazy dog.", "a", " ", "  ", "\n", "\n\n\n",
    "\t\tindented", "trailing spaces   ", "   leading spaces", "mixed \t whitespace \n runs",
    "It's a dog's life; they're here, we've gone, I'm sure you'll see, he'd know.",
    "ALL CAPS SENTENCE", "CamelCaseIdentifierName", "snake_case_identifier_name",
    "def f(x):\n    return x ** 2\n", "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "SELECT * FROM users WHERE id = 42;", "<div class=\"x\">text</div>", "{\"key\": [1, 2, 3], \"ok\": true}",
    "0", "12345", "3.14159265358979", "1,000,000", "2024-01-31T12:34:56Z", "+1 (555) 010-9999", "0xDEADBEEF",
    "x = 10**9 + 7", "😀", "emoji 😀🎉👍🏽 mixed", "👨‍👩‍👧‍👦 family", "日本語のテキストです。", "中文分词测试",
    "한국어 문장입니다", "Привет, мир! Как дела?", "Ελληνικά γράμματα", "مرحبا بالعالم", "שלום עולם",
    "café naïve résumé coöperate", "Ångström Ørsted Æsir", "Straße über Öl", "ñandú pingüino",
    "ﬁ ligature and ½ fraction", "math: ∑ ∫ √ ∞ ≠ ≤", "tab\there", "null\x00byte", "mixed 中文 and English 123",
    "URL https://example.com/path?q=1&r=2#frag", "email someone@example.org", "a.b.c.d", "---===+++",
    "<|im_start|>user\nhello<|im_end|>", "<|endoftext|>", "text before <|im_end|> text after", "<repo_name>x",
    "<|im_start", "im_end|>",
]


@pytest.mark.parametrize("special", [False, True])
def test_ids_equal_llama_cpp(smollm2, llama_ref, special):
    mismatches = []
    for s in STRINGS:
        ours = smollm2.tokenizer.encode(s, parse_special=special)
        ref = llama_ref.tokenize(s.encode("utf-8"), add_bos=False, special=special)
        if ours != ref:
            mismatches.append((s, ours, ref))
    assert not mismatches, mismatches[:5]


def test_plain_text_never_becomes_special(smollm2):
    tok = smollm2.tokenizer
    special_ids = set(range(17))  # SmolLM2's control tokens
    ids = tok.encode("<|im_start|>user\nhi<|im_end|><|endoftext|>")
    assert not special_ids & set(ids)
    assert set(tok.encode("<|im_start|>", parse_special=True)) == {1}


@pytest.mark.parametrize("s", [s for s in STRINGS if "<|" not in s and "<repo" not in s])
def test_decode_roundtrip(smollm2, s):
    tok = smollm2.tokenizer
    assert tok.decode(tok.encode(s)) == s


def test_incremental_detokenizer_never_emits_broken_utf8(smollm2):
    tok = smollm2.tokenizer
    text = "emoji 😀🎉👍🏽 and 日本語 and 👨‍👩‍👧‍👦 done"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # multi-byte characters span several byte-level tokens
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    assert "" in deltas[:-1]  # some token really was held back mid-character
