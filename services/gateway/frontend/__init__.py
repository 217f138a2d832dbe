"""The front end: requests beyond their connection -- prepared (tokenized, checked), streamed as events, kept in the durable log, detokenized into what clients see."""
