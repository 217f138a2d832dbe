"""Model files: names resolved to GGUFs (model_registry), their contents read memory-mapped (gguf_loader), and layer ranges (layers)."""
