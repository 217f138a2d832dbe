"""Everything one GGUF gives a runtime besides weights: config, tokenizer, chat template. Loaded once."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from shared.files.gguf_loader import GgufLoader
from shared.files.model_registry import resolve_model
from shared.models import ModelConfig
from shared.text.chat_template import BUILTIN_TEMPLATES, ChatTemplate, detect_template, template_source
from shared.text.tokenizer import GgufTokenizer

if TYPE_CHECKING:
    from shared.text.grammar import GrammarCompiler


@dataclass
class ModelFiles:
    name: str
    loader: GgufLoader
    chat_template_choice: str | None = None  # --chat-template: a built-in name or a file (None: the file's, or detected)

    @classmethod
    def open(cls, name: str, chat_template: str | None = None) -> ModelFiles:
        files = cls(name, GgufLoader(resolve_model(name)), chat_template)
        _ = files._template  # a --chat-template that names nothing fails here, before anything serves
        return files

    @cached_property
    def _template(self) -> tuple[str | None, str]:
        """(the chat template's source, where it comes from: "file", "built-in NAME (detected)", ...)."""
        if self.chat_template_choice is not None:
            return template_source(self.chat_template_choice)
        if self.loader.chat_template:
            return self.loader.chat_template, "the model file"
        name = detect_template(self.tokenizer.control_texts)
        if name is None:
            return None, "none"
        return BUILTIN_TEMPLATES[name], f"built-in {name} (the file has none; detected by its turn markers)"

    @property
    def chat_template_origin(self) -> str:
        return self._template[1]

    @property
    def chat_template_source(self) -> str | None:
        return self._template[0]

    @cached_property
    def config(self) -> ModelConfig:
        return ModelConfig.from_gguf(self.loader)

    @cached_property
    def tokenizer(self) -> GgufTokenizer:
        return GgufTokenizer.from_gguf(self.loader)

    @cached_property
    def grammars(self) -> GrammarCompiler:
        """Constrained decoding's compiler for this vocabulary (llguidance is imported here, never by a stage)."""
        from shared.text.grammar import GrammarCompiler

        return GrammarCompiler(self.tokenizer)

    @cached_property
    def chat_template(self) -> ChatTemplate | None:
        """The template chat requests render through: --chat-template's (chat_template_choice), else the file's own,
        else its family's detected by the vocabulary's turn markers (detect_template); None when there is none."""
        src = self._template[0]
        if not src:
            return None
        tok = self.tokenizer
        bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
        eos = tok.token_text(tok.eos_id) if tok.eos_id is not None else ""
        return ChatTemplate(src, bos_token=bos, eos_token=eos)

    def chat_prompt_ids(self, messages: list[dict], continue_final: bool = False) -> list[int]:
        """Render messages through the model's template and tokenize. Only the template's own markup becomes
        control tokens; every string from the messages is plain text, whatever it spells (issue 11).
        continue_final: the prompt ends inside the final (assistant) message, just after its content, so that the
        answer goes on with it (vLLM's continue_final_message) instead of opening a new turn."""
        from shared.errors import ChatTemplateError

        if self.chat_template is None:
            raise ChatTemplateError("this model's file has no chat template and its family is not one stagemesh knows "
                                    "by its turn markers: start it with --chat-template NAME|FILE (built-in: "
                                    f"{', '.join(BUILTIN_TEMPLATES)}), or send a plain prompt to /v1/completions")
        tok = self.tokenizer
        segments = self.chat_template.render_segments(messages, add_generation_prompt=not continue_final,
                                                      markup=tok.control_texts)
        if continue_final:
            segments = _cut_after_final_content(segments, messages[-1]["content"])
        bos = self.chat_template.bos_token
        # templates that write BOS themselves
        already_has_bos = bool(bos) and bool(segments) and not segments[0][1] and segments[0][0].startswith(bos)
        return tok.encode_segments(segments, add_bos=False if already_has_bos else None)


def _cut_after_final_content(segments: list[tuple[str, bool]], content: str) -> list[tuple[str, bool]]:
    """The prompt's pieces up to the end of the last message's content: what the template writes after it (the end
    of the turn) is left out. The last piece from the client must end with that content (templates may trim it)."""
    from shared.errors import ChatTemplateError

    last = max((i for i, (_, from_client) in enumerate(segments) if from_client), default=None)
    if last is None or not content.strip() or not segments[last][0].rstrip().endswith(content.strip()):
        raise ChatTemplateError("this model's chat template does not end the prompt with the final message's text, "
                                "so that message cannot be continued; leave continue_final_message out")
    return segments[:last + 1]
