"""What a micro-batch asks: each sequence's step (steps) and how its rows are sampled (sampling)."""
