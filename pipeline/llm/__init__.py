"""The LLM model code and its engine: one config-driven decoder, its checkpoints, tokenizers and prompt
formats, and the torch engine that batches requests (scheduler, cache rows, model runner)."""
