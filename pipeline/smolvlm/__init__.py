"""SmolVLM (the Idefics3 architecture): a SigLIP vision encoder, a pixel-shuffle connector, a LLaMA decoder."""
