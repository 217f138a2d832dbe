"""Text: the tokenizer, chat templates, grammars (constrained decoding) and streamed text."""
