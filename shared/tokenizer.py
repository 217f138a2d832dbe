"""Tokenizer built with the `tokenizers` library from GGUF metadata, matching llama.cpp's tokenization.

`gpt2` (byte-level BPE, pre-tokenizer chosen by tokenizer.ggml.pre) and `llama` (SentencePiece-style BPE with
byte fallback). Plain text never becomes special tokens; `parse_special=True` (rendered chat templates) does."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from shared.errors import GgufError
from shared.gguf_loader import GgufLoader

# llama.cpp token types (llama_token_type): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
CONTROL, USER_DEFINED, UNKNOWN, BYTE = 3, 4, 2, 6

_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_level_split(pattern: str):
    return [pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]


# tokenizer.ggml.pre -> pre-tokenizer pipeline (as llama.cpp's llama-vocab.cpp defines them).
PRE_TOKENIZERS = {
    "default": lambda: [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)],
    "gpt-2": lambda: [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)],
    # smollm / starcoder family: every digit alone, then the GPT-2 regex.
    "smollm": lambda: [pre_tokenizers.Digits(individual_digits=True), *_byte_level_split(_GPT2_RE)],
    "starcoder": lambda: [pre_tokenizers.Digits(individual_digits=True), *_byte_level_split(_GPT2_RE)],
    "refact": lambda: [pre_tokenizers.Digits(individual_digits=True), *_byte_level_split(_GPT2_RE)],
    "llama-bpe": lambda: _byte_level_split(_LLAMA3_RE),
    "llama3": lambda: _byte_level_split(_LLAMA3_RE),
    "qwen2": lambda: _byte_level_split(_QWEN2_RE),
}
_IGNORE_MERGES = {"llama-bpe", "llama3"}


@dataclass
class GgufTokenizer:
    plain: Tokenizer  # special-token text stays text
    special: Tokenizer  # special-token text becomes control tokens
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    vocab_size: int
    eos_ids: frozenset[int] = field(default_factory=frozenset)  # every id that ends generation

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
        else:
            raise GgufError(f"tokenizer model {kind!r} is not supported; supported: gpt2 (byte-level BPE), llama (SentencePiece)")
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
        return cls(plain=plain, special=tok, bos_id=None if bos is None else int(bos),
                   eos_id=None if eos is None else int(eos),
                   add_bos=bool(loader.get("tokenizer.ggml.add_bos_token", default_bos)),
                   vocab_size=len(tokens), eos_ids=frozenset(eos_ids))

    def encode(self, text: str, parse_special: bool = False, add_bos: bool | None = None) -> list[int]:
        """Token ids for text. BOS is prepended when the model asks for it (add_bos=None) or when told to."""
        tok = self.special if parse_special else self.plain
        ids = tok.encode(text, add_special_tokens=False).ids
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
    merges = [tuple(m.split(" ", 1)) for m in loader.get("tokenizer.ggml.merges") or []]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _IGNORE_MERGES))
    tok.pre_tokenizer = pre_tokenizers.Sequence(PRE_TOKENIZERS[pre]())
    tok.decoder = decoders.ByteLevel()
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
