"""The prompts the SAM parity tests (`test_sam_parity.py`, `test_mobile_sam.py`) give both models, in the
1024-px model input's pixels, and as the tensors both take."""

import torch

PROMPTS = {
    "point": dict(points=([[500.0, 375.0]], [1])),
    "multi_point": dict(points=([[500.0, 375.0], [120.5, 800.0], [900.0, 60.0]], [1, 0, 1])),
    "box": dict(box=[100.0, 200.0, 700.0, 650.0]),
    "box_and_point": dict(points=([[400.0, 400.0]], [0]), box=[100.0, 200.0, 700.0, 650.0]),
}


def prompt_tensors(prompt: dict) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, torch.Tensor | None]:
    """((coords [1, N, 2], labels [1, N]) or None, box [1, 4] or None)."""
    points = None
    if "points" in prompt:
        coords, labels = prompt["points"]
        points = (torch.tensor([coords]), torch.tensor([labels]))
    box = torch.tensor([prompt["box"]]) if "box" in prompt else None
    return points, box
