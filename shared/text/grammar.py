"""Constrained decoding: a JSON schema (response_format, a forced tool call) compiled by llguidance -- the library
llama.cpp and vLLM use -- into a matcher per sequence. The matcher lives with the sequence's history (the gateway);
before each sampling step it gives the allowed tokens as a bitmask, which travels with the step to the last stage
(shared.batch.sampling.LogitInputs), and it consumes each sampled token. A replay after a stage dies needs nothing
rebuilt: the matcher has consumed exactly the tokens the sequence kept."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from functools import cached_property

import llguidance

from shared.text.tokenizer import GgufTokenizer

# JSON as models saw it in training (", " and ": " between items, no other whitespace): flexible whitespace lets a
# small model pad with newlines for ever.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
JSON_OBJECT = {"type": "object"}  # response_format {"type": "json_object"}: any object
COMPILED_CACHE = 64  # distinct grammars kept compiled (a pristine matcher each, copied per request)


class GrammarError(ValueError):
    """A schema llguidance cannot compile; the message says what is wrong."""


def json_schema_grammar(schema: dict) -> str:
    """The llguidance grammar text for a JSON schema (not yet checked: GrammarCompiler.matcher does)."""
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_STYLE)
    except (TypeError, ValueError) as e:
        raise GrammarError(f"the JSON schema is not a JSON object: {e}") from None


class SequenceGrammar:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self._matcher = matcher
        self._mask: bytes | None = None  # the allowed tokens of the next step, until a token is consumed

    def allowed(self) -> bytes:
        """The next token's allowed set, as LogitInputs.allowed wants it (EOS alone once the grammar is complete)."""
        if self._mask is None:
            self._mask = self._matcher.compute_bitmask()
        return self._mask

    def consume(self, token: int) -> bool:
        """Advance past a sampled token; False when the grammar refuses it (see `error`)."""
        self._mask = None
        return self._matcher.consume_token(token)

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None

    @property
    def complete(self) -> bool:
        return self._matcher.is_accepting()


class GrammarCompiler:
    """Compiles grammars for one tokenizer, keeping the COMPILED_CACHE most recent (a repeated schema -- every call of
    an agent's tool, a client's response model -- compiles once). Thread-safe: the gateway compiles off its loop."""

    def __init__(self, tokenizer: GgufTokenizer):
        self._tokenizer = tokenizer
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    @cached_property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary (each token's bytes, the EOS ids), built once: it walks the whole
        vocabulary."""
        tok = self._tokenizer
        return llguidance.LLTokenizer(tok.special.to_str(), n_vocab=tok.vocab_size, eos_token=sorted(tok.eos_ids))

    def matcher(self, grammar: str) -> SequenceGrammar:
        """A fresh matcher at the start of `grammar`; GrammarError naming the problem if it does not compile."""
        with self._lock:
            pristine = self._compiled.get(grammar)
            if pristine is not None:
                self._compiled.move_to_end(grammar)
                return SequenceGrammar(pristine.deep_copy())
        lltok = self.lltokenizer
        problem = llguidance.LLMatcher.validate_grammar(grammar, lltok)
        if problem:
            raise GrammarError(problem.splitlines()[0][:500])
        pristine = llguidance.LLMatcher(lltok, grammar, log_level=0)
        if pristine.is_error():
            raise GrammarError(pristine.get_error().splitlines()[0][:500])
        with self._lock:
            self._compiled[grammar] = pristine
            while len(self._compiled) > COMPILED_CACHE:
                self._compiled.popitem(last=False)
        return SequenceGrammar(pristine.deep_copy())

    @property
    def cached(self) -> int:
        return len(self._compiled)
