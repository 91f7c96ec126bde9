"""MiniGPT-4: BLIP-2's EVA ViT-g and Q-Former, a linear projection, and a Vicuna/LLaMA LLM; the vision
encoder's engine and the prompt template."""
