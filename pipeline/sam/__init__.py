"""SAM (Segment Anything): model parts named after the paper, and their checkpoints."""
