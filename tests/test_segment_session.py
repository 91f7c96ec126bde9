"""SegmentSession on the demo SAM: clicks, boxes, undo, refinement, choosing, bad input, own statistics."""

import numpy as np
import pytest

from studio.backends import sam_engine
from pipeline.errors import UserError
from pipeline.images import load_image
from pipeline.sam.model import load_sam
from pipeline.sam.weights import resolve_sam
from pipeline.pipelines.segment import SegmentPipeline
from pipeline.pipelines.segment_session import Prompts, SegmentSession


class RecordingPipeline(SegmentPipeline):
    """The real pipeline, remembering the arguments of each `predict`."""

    calls: list[dict]

    def predict(self, handle, points=(), labels=(), box=None, mask_input=None, multimask=True, stats=None, size=None):
        self.calls.append(dict(points=points, labels=labels, box=box, mask_input=mask_input))
        return super().predict(handle, points, labels, box, mask_input, multimask, stats, size)


@pytest.fixture(scope="module")
def seg(studio_cache):
    return RecordingPipeline(sam_engine(load_sam(resolve_sam("demo/sam-tiny", studio_cache))), is_demo=True)


@pytest.fixture
def session(seg):
    seg.calls = []
    return SegmentSession(seg, load_image("assets/examples/shapes.jpg"))  # 800×600


def test_clicks_refine_the_chosen_candidate(session, seg):
    session.click(100, 200)
    first = session.prediction
    assert session.prompts == Prompts(((100, 200),), (1,))
    assert session.mask.shape == (600, 800) and session.chosen == int(np.argmax(first.scores))
    assert seg.calls[-1]["mask_input"] is None
    session.choose(2)
    session.click(500, 300, positive=False)
    assert session.prompts.labels == (1, 0)
    assert np.array_equal(seg.calls[-1]["mask_input"], first.low_res_logits[2])  # the chosen one, fed back


def test_undo_a_point_and_a_box(session, seg):
    session.click(100, 200)
    session.box_corner(80, 120)
    assert session.corner == (80, 120) and session.prompts.box is None and len(seg.calls) == 1  # half a box
    session.box_corner(330, 370)
    assert session.prompts.box == (80, 120, 330, 370) and session.corner is None
    session.undo()  # the box goes, the point stays, masks predicted afresh
    assert session.prompts == Prompts(((100, 200),), (1,))
    assert seg.calls[-1]["box"] is None and seg.calls[-1]["mask_input"] is None
    session.undo()  # the point goes: nothing left to predict
    assert session.prompts == Prompts() and session.prediction is None and session.mask is None
    session.undo()  # nothing to undo: no change
    assert session.prompts == Prompts()


def test_undo_drops_a_half_drawn_box_first(session):
    session.click(100, 200)
    session.box_corner(10, 10)
    session.undo()
    assert session.corner is None and session.prompts.points == ((100, 200),)


def test_a_new_box_replaces_the_old_and_undo_brings_it_back(session):
    session.box_corner(80, 120)
    session.box_corner(330, 370)
    session.box_corner(400, 300)
    session.box_corner(500, 500)
    assert session.prompts.box == (400, 300, 500, 500)
    session.undo()
    assert session.prompts.box == (80, 120, 330, 370)


@pytest.mark.parametrize("first, second", [((80, 120), (330, 370)), ((330, 370), (80, 120)),
                                           ((330, 120), (80, 370)), ((80, 370), (330, 120))])
def test_box_corners_in_either_order(session, first, second):
    session.box_corner(*first)
    session.box_corner(*second)
    assert session.prompts.box == (80, 120, 330, 370)


def test_clear_keeps_the_image_and_statistics(session):
    session.click(100, 200)
    session.box_corner(10, 10)
    runs = session.stats.encoder_runs
    session.clear()
    assert session.prompts == Prompts() and session.corner is None and session.prediction is None
    session.undo()  # the history went too
    assert session.prompts == Prompts()
    session.click(300, 300)
    assert session.stats.encoder_runs == runs and session.prediction is not None


def test_choose_needs_an_existing_candidate(session):
    with pytest.raises(UserError, match="no candidates yet"):
        session.choose(0)
    session.click(100, 200, multimask=False)
    with pytest.raises(UserError, match="no candidate #2"):
        session.choose(1)
    with pytest.raises(UserError, match="no candidate #0"):
        session.choose(-1)
    session.choose(0)
    assert session.chosen == 0


@pytest.mark.parametrize("x, y", [(800, 10), (-1, 10), (10, 600)])
def test_clicks_outside_the_image_change_nothing(session, x, y):
    session.click(100, 200)
    before = session.prediction
    with pytest.raises(UserError, match="outside the 800×600 image"):
        session.click(x, y)
    with pytest.raises(UserError, match="outside the 800×600 image"):
        session.box_corner(x, y)
    assert session.prompts.points == ((100, 200),) and session.prediction is before and session.corner is None
    session.undo()
    assert session.prompts == Prompts()  # the failed clicks left no undo step


def test_a_box_without_area_is_refused_and_the_corner_kept(session):
    session.box_corner(100, 100)
    with pytest.raises(UserError, match="x0 < x1"):
        session.box_corner(100, 300)
    assert session.corner == (100, 100) and session.prompts.box is None
    session.box_corner(200, 300)
    assert session.prompts.box == (100, 100, 200, 300)


def test_two_sessions_count_their_own_work(seg):
    image = np.random.default_rng(5).integers(0, 255, (120, 160, 3), dtype=np.uint8)  # new to the cache
    first = SegmentSession(seg, image)
    assert (first.stats.encoder_runs, first.stats.cache_hits) == (1, 0) and first.stats.last_encoder_ms > 0
    second = SegmentSession(seg, image.copy())  # same picture, another user: the cached embedding
    first.click(10, 10)
    first.click(50, 60)
    first.everything()
    assert (first.stats.encoder_runs, first.stats.cache_hits) == (1, 3) and first.stats.last_decoder_ms > 0
    assert (second.stats.encoder_runs, second.stats.cache_hits) == (0, 1)
    assert second.stats.last_encoder_ms == 0 and second.stats.last_decoder_ms == 0


def test_masks_come_at_the_shown_size_and_full_size_for_download(seg):
    """A big photo's clicks move masks at the size the UI shows; the download is full size and equals
    what `predict` gives at the original size."""
    photo = load_image("assets/examples/shapes.jpg")  # 800×600
    shown = (300, 400)
    session = SegmentSession(seg, photo, shown)
    session.click(200, 150)
    assert session.mask.shape == shown
    full = session.full_mask()
    reference = seg.predict(session.handle, [(200, 150)], [1])
    assert full.shape == photo.shape[:2] and np.array_equal(full, reference.masks[session.chosen])
    halved = full.reshape(300, 2, 400, 2)[:, 0, :, 0]
    assert (halved == session.mask).mean() > 0.98  # the same mask, sampled at the shown size
    assert [m.mask.shape for m in session.everything()][:1] in ([], [shown])


def test_display_copies_on_the_device_are_shared_by_image_bounded_and_counted(seg):
    """The pipeline keeps display copies where SAM runs for the last few images only (a thousand
    sessions must not hold one each); two sessions on one photo share a copy; they count in the
    memory budget (`held_bytes`) and go with an unload."""
    import torch

    from pipeline.pipelines import segment

    rng = np.random.default_rng(3)
    images = [rng.integers(0, 255, (60, 80, 3), dtype=np.uint8) for _ in range(segment.DISPLAY_COPIES + 1)]
    sessions = [SegmentSession(seg, image) for image in images]
    before = seg.held_bytes()
    first = sessions[0].display_copy(images[0])
    assert SegmentSession(seg, images[0].copy()).display_copy(images[0].copy()) is first  # same pixels: one copy
    assert seg.held_bytes() == before + first.nbytes
    for session, image in zip(sessions[1:], images[1:]):  # the least recently used (image 0) goes
        session.display_copy(image)
    assert len(seg._display) == segment.DISPLAY_COPIES and all(key[0] != sessions[0].handle.key for key in seg._display)
    again = sessions[0].display_copy(images[0])
    assert again is not first and torch.equal(again, torch.from_numpy(images[0]))


def test_a_demo_sams_status_says_its_masks_mean_nothing(session, seg):
    """The page's banner is decided as it is built; a demo that runs because MobileSAM could not be downloaded
    is said beside every mask."""
    from app.segment_render import status_line

    session.click(400, 300, True)
    assert status_line(session).startswith("**Demo SAM with random weights")
    seg.is_demo = False
    try:
        assert status_line(session).startswith("1 point")
    finally:
        seg.is_demo = True
