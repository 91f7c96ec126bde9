"""SAM (Segment Anything): model parts named after the paper, their checkpoints, and the engine that runs them."""
