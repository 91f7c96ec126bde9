"""The LLM core: one config-driven decoder, its loaders, tokenizers and the generation loop."""
