"""Everything one GGUF gives a runtime besides weights: config, tokenizer, chat template. Loaded once."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from shared.chat_template import ChatTemplate
from shared.gguf_loader import GgufLoader
from shared.model_registry import resolve_model
from shared.models import ModelConfig
from shared.tokenizer import GgufTokenizer

if TYPE_CHECKING:
    from shared.grammar import GrammarCompiler


@dataclass
class ModelFiles:
    name: str
    loader: GgufLoader

    @classmethod
    def open(cls, name: str) -> ModelFiles:
        return cls(name, GgufLoader(resolve_model(name)))

    @cached_property
    def config(self) -> ModelConfig:
        return ModelConfig.from_gguf(self.loader)

    @cached_property
    def tokenizer(self) -> GgufTokenizer:
        return GgufTokenizer.from_gguf(self.loader)

    @cached_property
    def grammars(self) -> GrammarCompiler:
        """Constrained decoding's compiler for this vocabulary (llguidance is imported here, never by a stage)."""
        from shared.grammar import GrammarCompiler

        return GrammarCompiler(self.tokenizer)

    @cached_property
    def chat_template(self) -> ChatTemplate | None:
        src = self.loader.chat_template
        if not src:
            return None
        tok = self.tokenizer
        bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
        eos = tok.token_text(tok.eos_id) if tok.eos_id is not None else ""
        return ChatTemplate(src, bos_token=bos, eos_token=eos)

    def chat_prompt_ids(self, messages: list[dict]) -> list[int]:
        """Render messages through the model's template and tokenize. Only the template's own markup becomes
        control tokens; every string from the messages is plain text, whatever it spells (issue 11)."""
        from shared.errors import ChatTemplateError

        if self.chat_template is None:
            raise ChatTemplateError(f"{self.loader.path} has no tokenizer.chat_template; send a plain prompt instead")
        tok = self.tokenizer
        segments = self.chat_template.render_segments(messages, add_generation_prompt=True, markup=tok.control_texts)
        bos = self.chat_template.bos_token
        # templates that write BOS themselves
        already_has_bos = bool(bos) and bool(segments) and not segments[0][1] and segments[0][0].startswith(bos)
        return tok.encode_segments(segments, add_bos=False if already_has_bos else None)
