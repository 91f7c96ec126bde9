"""MiniGPT-4: BLIP-2's EVA ViT-g and Q-Former, a linear projection, and a Vicuna/LLaMA LLM."""
