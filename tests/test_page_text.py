"""What the page's heading says about where the tools run."""

import torch

from app.ui import heading


def test_the_heading_says_cpu_or_gpu():
    assert heading(torch.device("cpu")).endswith("on this machine's CPU</span>")
    assert heading(torch.device("cuda", 0)).endswith("on this machine's GPU</span>")
