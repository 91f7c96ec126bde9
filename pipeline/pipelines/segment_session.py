"""SegmentSession: one user's prompting on one image — clicks, a box, undo, refinement, the chosen mask.

The state machine lives here rather than in the UI so every front end (the Gradio tab, a script,
a future API) prompts the same way and it is tested without a browser. Coordinates are the
original image's pixels. Each new prompt refines the mask the user chose last (its low-res
logits go back into the decoder); undo restores the previous prompts and predicts afresh. A
failed step (a click outside the image, a box with no area) raises `UserError` and changes
nothing. The session's `SegmentStats` count only this user's work.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from pipeline.errors import UserError
from pipeline.pipelines.segment import (AutoMask, ImageHandle, Prediction, SegmentPipeline, SegmentStats, check_point,
                              check_prompts)


@dataclasses.dataclass(frozen=True)
class Prompts:
    points: tuple[tuple[float, float], ...] = ()
    labels: tuple[int, ...] = ()  # 1 object, 0 background, one per point
    box: tuple[float, float, float, float] | None = None  # x0, y0, x1, y1 with x0 < x1, y0 < y1

    @property
    def empty(self) -> bool:
        return not self.points and self.box is None


class SegmentSession:
    def __init__(self, pipeline: SegmentPipeline, image: np.ndarray, shown: tuple[int, int] | None = None):
        """Start prompting on `image` (RGB uint8 [H, W, 3]), encoding it unless cached. Masks come at
        the `shown` size (height, width: the copy the UI draws on), else at the image's; a download
        asks for the full-size one (`full_mask`), so a click on a big photo moves no full-size masks."""
        self.pipeline = pipeline
        self.shown = shown
        self.stats = SegmentStats()
        self.handle: ImageHandle = pipeline.set_image(image, self.stats)
        self.prompts = Prompts()
        self.corner: tuple[float, float] | None = None  # the first corner of a box being drawn
        self.prediction: Prediction | None = None
        self.chosen = 0  # index of the chosen candidate in `prediction`
        self._history: list[Prompts] = []  # the prompts before each step, for undo

    def rebind(self, pipeline: SegmentPipeline) -> None:
        """Continue on `pipeline` (the tool was unloaded and loaded again): the image is encoded there;
        prompts, masks and the chosen candidate stay."""
        self.handle = pipeline.set_image(self.handle.image, self.stats)
        self.pipeline = pipeline

    @property
    def mask(self) -> np.ndarray | None:
        """The chosen candidate, bool at the shown size; None before the first prompt."""
        return self.prediction.masks[self.chosen] if self.prediction is not None else None

    def full_mask(self) -> np.ndarray | None:
        """The chosen candidate at the image's full size (for a download); None before the first prompt."""
        if self.prediction is None:
            return None
        return self.pipeline.full_size_mask(self.handle, self.prediction.low_res_logits[self.chosen])

    def click(self, x: float, y: float, positive: bool = True, multimask: bool = True) -> None:
        """Add a point on the object (`positive`) or on the background."""
        p = self.prompts
        self._step(dataclasses.replace(p, points=p.points + ((x, y),), labels=p.labels + (int(positive),)),
                   multimask)

    def box_corner(self, x: float, y: float, multimask: bool = True) -> None:
        """One corner of a box: the first is remembered, the second (any opposite corner) makes the box,
        replacing an earlier one."""
        check_point(x, y, self.handle.size)
        if self.corner is None:
            self.corner = (x, y)
            return
        (x0, y0), (x1, y1) = self.corner, (x, y)
        box = (min(x0, x1), min(y0, y1), max(x0, x1), max(y0, y1))
        self._step(dataclasses.replace(self.prompts, box=box), multimask)
        self.corner = None

    def prompt(self, points: Sequence[Sequence[float]], labels: Sequence[int], box: Sequence[float] | None,
               multimask: bool = True) -> None:
        """Prompts given all at once (an API request): the points with their labels and/or a box,
        in place of the session's earlier ones."""
        check_prompts(points, labels, box, self.handle.size)  # none at all is an error here, not a clear
        self._step(Prompts(tuple(tuple(p) for p in points), tuple(labels), tuple(box) if box is not None else None),
                   multimask)

    def display_copy(self, display: np.ndarray) -> torch.Tensor:
        """`display` (the UI's copy of this image) where SAM runs, kept there by the pipeline."""
        return self.pipeline.display_copy(self.handle, display)

    @property
    def device(self) -> torch.device:
        return self.pipeline.engine.device

    def undo(self, multimask: bool = True) -> None:
        """Drop a half-drawn box, else the last point or box (masks predicted again from what is left)."""
        if self.corner is not None:
            self.corner = None
        elif self._history:
            previous = self._history[-1]
            self._show(previous, self._predict(previous, None, multimask))
            self._history.pop()

    def clear(self) -> None:
        """Back to the bare image (the embedding stays cached, the statistics keep counting)."""
        self._show(Prompts(), None)
        self.corner = None
        self._history.clear()

    def choose(self, index: int) -> None:
        """Make candidate `index` the mask shown, downloaded and refined by the next prompt."""
        if self.prediction is None:
            raise UserError("no candidates yet: click on the image first")
        count = len(self.prediction.scores)
        if not 0 <= index < count:
            raise UserError(f"there is no candidate #{index + 1}: this prompt gave {count}")
        self.chosen = index

    def everything(self) -> list[AutoMask]:
        """Every confident, stable mask in the image (see `SegmentPipeline.segment_everything`)."""
        return self.pipeline.segment_everything(self.handle, stats=self.stats, size=self.shown)

    def _step(self, prompts: Prompts, multimask: bool) -> None:
        refine = self.prediction.low_res_logits[self.chosen] if self.prediction is not None else None
        prediction = self._predict(prompts, refine, multimask)  # raises before anything changes
        self._history.append(self.prompts)
        self._show(prompts, prediction)

    def _predict(self, prompts: Prompts, refine: np.ndarray | None, multimask: bool) -> Prediction | None:
        if prompts.empty:
            return None
        return self.pipeline.predict(self.handle, prompts.points, prompts.labels, prompts.box, refine, multimask,
                                     self.stats, self.shown)

    def _show(self, prompts: Prompts, prediction: Prediction | None) -> None:
        self.prompts, self.prediction = prompts, prediction
        self.chosen = int(np.argmax(prediction.scores)) if prediction is not None else 0
