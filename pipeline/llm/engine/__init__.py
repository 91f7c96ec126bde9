"""The serving engine: its contract (`seam`), the torch engine's thread loop, scheduler, cache rows, model runner and sampler."""
