"""Tokenizer built with the `tokenizers` library from GGUF metadata, matching llama.cpp's tokenization.

`gpt2` (byte-level BPE, pre-tokenizer chosen by tokenizer.ggml.pre), `llama` (SentencePiece-style BPE with byte
fallback) and `gemma4` (BPE over UTF-8 with ▁ for spaces and byte fallback); every causal-LM vocabulary of
llama.cpp's tokenizer suite passes (tests/test_vocab_suite.py). Plain text never becomes special tokens;
`parse_special=True` does, and `encode_segments` parses them only in a chat template's own text."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from shared.errors import GgufError
from shared.files.gguf_loader import GgufLoader

# llama.cpp token types (llama_token_type): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
CONTROL, USER_DEFINED, UNKNOWN, BYTE = 3, 4, 2, 6

_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")


_GPT2_NO_TAIL_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_QWEN35_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"  # 一-龥ࠀ-一가-퟿, as llama-vocab.cpp writes it
# llama-vocab.cpp's DEEPSEEK_LLM letter class, code point for code point (escaped: NFC must not touch it)
_DEEPSEEK_LETTERS = ("\\s?[" +
                     "A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376"
                     "\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
                     "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf"
                     "\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
                     "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4"
                     "\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
                     "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
                     "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
                     "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
                     "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
                     "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
                     "]+")


def _byte_level_split(*patterns: str):
    """llama.cpp's scheme: each regex splits the pieces the previous ones left (matches and the text between them
    both kept), then GPT-2 byte-level encoding."""
    return [*(pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]


# tokenizer.ggml.pre -> pre-tokenizer pipeline, as llama.cpp's llama-vocab.cpp (llm_tokenizer_bpe) defines each
# pre-type's regex list; every entry is checked against llama.cpp's own vocabulary test suite
# (tests/test_vocab_suite.py); "default" (a GGUF without tokenizer.ggml.pre) against llama-cpp-python itself.
PRE_TOKENIZERS = {
    "default": lambda: _byte_level_split(r"[\p{P}\$\+<=>\^~\|]+", _GPT2_NO_TAIL_RE, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt-2": lambda: [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)],
    "mpt": lambda: [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)],
    # smollm / starcoder family: every digit alone, then the GPT-2 regex.
    "smollm": lambda: [pre_tokenizers.Digits(individual_digits=True), *_byte_level_split(_GPT2_RE)],
    "starcoder": lambda: [pre_tokenizers.Digits(individual_digits=True), *_byte_level_split(_GPT2_RE)],
    "refact": lambda: [pre_tokenizers.Digits(individual_digits=True), *_byte_level_split(_GPT2_RE)],
    "command-r": lambda: [pre_tokenizers.Digits(individual_digits=True), *_byte_level_split(_GPT2_RE)],
    "llama-bpe": lambda: _byte_level_split(_LLAMA3_RE),
    "llama3": lambda: _byte_level_split(_LLAMA3_RE),
    "qwen2": lambda: _byte_level_split(_QWEN2_RE),
    "qwen35": lambda: _byte_level_split(_QWEN35_RE),
    "falcon": lambda: _byte_level_split(r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_NO_TAIL_RE, r"[0-9][0-9][0-9]"),
    "deepseek-coder": lambda: _byte_level_split(r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}"),
    "deepseek-llm": lambda: _byte_level_split(r"[\r\n]", _DEEPSEEK_LETTERS, "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
                                              r"\s+$", _CJK_HANGUL, r"\p{N}+"),
}
_IGNORE_MERGES = {"llama-bpe", "llama3"}

# Tokens that end generation by their text, whatever the metadata says (llama-vocab.cpp's special_eog_ids list, e.g.
# gemma's <end_of_turn>, which converted GGUFs do not name as eot_token_id); "</s>" is a normal token in the vocabularies
# that carry one of _NORMAL_S_MARKERS (gemma4, plamo), as there.
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>",
    "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
})
_NORMAL_S_MARKERS = ("<|tool_response>", "<|plamo:eos|>")


@dataclass
class GgufTokenizer:
    plain: Tokenizer  # special-token text stays text
    special: Tokenizer  # special-token text becomes control tokens
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    vocab_size: int
    eos_ids: frozenset[int] = field(default_factory=frozenset)  # every id that ends generation
    control: dict[str, int] = field(default_factory=dict)  # control-token text -> id (parsed only when asked)

    @property
    def control_texts(self) -> tuple[str, ...]:
        return tuple(self.control)

    @cached_property
    def _control_pattern(self) -> re.Pattern | None:
        texts = sorted(self.control, key=len, reverse=True)  # leftmost, then longest (as the special tokenizer)
        return re.compile("|".join(re.escape(t) for t in texts)) if texts else None

    @classmethod
    def from_gguf(cls, loader: GgufLoader) -> GgufTokenizer:
        kind = loader.get("tokenizer.ggml.model")
        tokens = loader.get("tokenizer.ggml.tokens")
        if not tokens:
            raise GgufError(f"{loader.path} carries no tokenizer (tokenizer.ggml.tokens is missing)")
        types = list(loader.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        if kind == "gpt2":
            tok = _gpt2(loader, tokens)
            default_bos = False
        elif kind == "llama":
            tok = _sentencepiece(loader, tokens, types)
            default_bos = True
        elif kind == "gemma4":
            tok = _gemma4(loader, tokens)
            default_bos = False
        else:
            raise GgufError(f"tokenizer model {kind!r} is not supported; supported: gpt2 (byte-level BPE), llama "
                            f"(SentencePiece), gemma4 (SentencePiece-style BPE over UTF-8); bert (WordPiece) and t5 "
                            f"(Unigram) vocabularies belong to encoders, not causal language models stagemesh serves")
        added = [AddedToken(t, special=(ty == CONTROL), normalized=False)
                 for t, ty in zip(tokens, types) if ty in (CONTROL, USER_DEFINED)]
        tok.add_tokens(added)
        plain = Tokenizer.from_str(tok.to_str())
        plain.encode_special_tokens = True
        bos = loader.get("tokenizer.ggml.bos_token_id")
        eos = loader.get("tokenizer.ggml.eos_token_id")
        eos_ids = {int(eos)} if eos is not None else set()
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            if loader.get(key) is not None:
                eos_ids.add(int(loader.get(key)))
        eog_texts = EOG_TEXTS - ({"</s>"} if any(m in tokens for m in _NORMAL_S_MARKERS) else set())
        eos_ids |= {i for i, t in enumerate(tokens) if t in eog_texts}
        control = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == CONTROL and t}
        return cls(plain=plain, special=tok, bos_id=None if bos is None else int(bos),
                   eos_id=None if eos is None else int(eos),
                   add_bos=bool(loader.get("tokenizer.ggml.add_bos_token", default_bos)),
                   vocab_size=len(tokens), eos_ids=frozenset(eos_ids), control=control)

    def encode(self, text: str, parse_special: bool = False, add_bos: bool | None = None) -> list[int]:
        """Token ids for text. BOS is prepended when the model asks for it (add_bos=None) or when told to."""
        tok = self.special if parse_special else self.plain
        ids = tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def encode_segments(self, segments: list[tuple[str, bool]], add_bos: bool | None = None) -> list[int]:
        """Token ids for a prompt made of (text, from_client) pieces: control-token text becomes a control token
        only inside the template's own pieces; client pieces are always plain text.

        Everything between two control tokens is tokenized as one run of plain text, template and client text
        together, so a seam tokenizes exactly as the same text would without one (a leading space merges into the
        client's first word, as it would in the rendered string). This is llama.cpp's own scheme: its tokenizer
        splits a prompt into a fragment buffer of special tokens and raw text and tokenizes each raw fragment
        plainly; here client text simply never yields a special fragment. With no control text in client pieces
        the result equals `encode("".join(texts), parse_special=True)`."""
        ids: list[int] = []
        run: list[str] = []

        def flush():
            if run:
                ids.extend(self.plain.encode("".join(run), add_special_tokens=False).ids)
                run.clear()

        for text, from_client in segments:
            if from_client or self._control_pattern is None:
                run.append(text)
                continue
            at = 0
            for m in self._control_pattern.finditer(text):
                run.append(text[at:m.start()])
                flush()
                ids.append(self.control[m.group()])
                at = m.end()
            run.append(text[at:])
        flush()
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.special.decode(ids, skip_special_tokens=skip_special)

    def token_text(self, token_id: int) -> str:
        return self.special.id_to_token(token_id) or ""


def _gpt2(loader: GgufLoader, tokens: list[str]) -> Tokenizer:
    pre = loader.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GgufError(f"pre-tokenizer {pre!r} is not supported; supported: {', '.join(sorted(PRE_TOKENIZERS))}")
    merges = _merges(loader)
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _IGNORE_MERGES))
    tok.pre_tokenizer = pre_tokenizers.Sequence(PRE_TOKENIZERS[pre]())
    tok.decoder = decoders.ByteLevel()
    return tok


def _merges(loader: GgufLoader) -> list[tuple[str, str]]:
    """BPE merges "left right", split at the first space after the first character (as llama.cpp does)."""
    out = []
    for m in loader.get("tokenizer.ggml.merges") or []:
        cut = m.find(" ", 1)
        if cut < 0:
            raise GgufError(f"{loader.path}: BPE merge {m!r} has no space; the file's tokenizer.ggml.merges is corrupt")
        out.append((m[:cut], m[cut + 1:]))
    return out


def _gemma4(loader: GgufLoader, tokens: list[str]) -> Tokenizer:
    """Gemma 4: BPE with the GGUF's merges over raw UTF-8, spaces written as ▁, bytes as <0xNN> fallback tokens,
    words split only at runs of newlines (llama.cpp's LLAMA_VOCAB_PRE_TYPE_GEMMA4)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = loader.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges(loader), byte_fallback=True,
                               unk_token=None if unk is None else tokens[int(unk)]))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


def _sentencepiece(loader: GgufLoader, tokens: list[str], types: list[int]) -> Tokenizer:
    """SentencePiece BPE: merges ranked by the score of the merged piece, bytes as <0xNN> fallback tokens."""
    scores = list(loader.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for piece, score, ty in zip(tokens, scores, types):
        if ty != 1 or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    unk_id = loader.get("tokenizer.ggml.unknown_token_id", 0)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(r[3], r[4]) for r in ranked], unk_token=tokens[unk_id],
                               byte_fallback=True, fuse_unk=True))
    steps = [normalizers.Replace(" ", "▁")]
    if loader.get("tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never end inside a UTF-8 sequence.

    Decodes a short window [prefix_offset, len) and emits only text beyond what the window's first part already
    produced; a delta ending in U+FFFD (an incomplete byte sequence) waits for the next token."""

    def __init__(self, tokenizer: GgufTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self._prefix_offset:self._read_offset])
        full = self.tokenizer.decode(self.ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back at the end of the stream (possibly with U+FFFD for truly broken bytes)."""
        prefix = self.tokenizer.decode(self.ids[self._prefix_offset:self._read_offset])
        full = self.tokenizer.decode(self.ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self.ids)
        return full[len(prefix):]
