"""Replaying captured CUDA graphs: the one way the pipelines cut kernel-launch overhead.

A decode step, a click and an image encode are each hundreds of small kernels whose launches cost
more than their math. `CapturedCall` records one call of a function for fixed input shapes and
replays it: each call copies the new inputs into the graph's own buffers, replays, and returns
copies of the outputs. Callers keep one per shape and serialise calls (the buffers are shared).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from plugins.cuda_streams import capture_stream, capturing


def _clone(out):
    return tuple(_clone(o) for o in out) if isinstance(out, tuple) else out.clone()


class CapturedCall:
    def __init__(self, fn: Callable, *example: Tensor | None, pool=None, warm_up: bool = True):
        """`warm_up`: run `fn` once outside the graph first, so that lazy set-up (cuBLAS's workspace, a
        library's first call) does not happen inside the capture; a caller capturing many shapes of one
        function warms up the first only (the run costs as much as the capture: 36 step graphs of a 7B chat
        took 2.6 s with it, 1.4 s without, H200, 2026-11-30) and retries a capture that failed with it."""
        self.inputs = [t.clone() if t is not None else None for t in example]
        with capturing():  # alone in the process, on a stream no engine holds (`plugins.cuda_streams`)
            stream = capture_stream()
            stream.wait_stream(torch.cuda.current_stream())
            if warm_up:
                with torch.cuda.stream(stream):
                    fn(*self.inputs)
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's engine may launch, synchronise or allocate on its own stream
            # meanwhile; in the default global mode that invalidated this capture ("operation not permitted
            # when stream is capturing", two engines at once, H200)
            with torch.cuda.graph(self.graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                self.outputs = fn(*self.inputs)
            torch.cuda.current_stream().wait_stream(stream)

    def __call__(self, *args: Tensor | None):
        for buffer, value in zip(self.inputs, args):
            if buffer is not None:
                buffer.copy_(value)
        self.graph.replay()
        return _clone(self.outputs)

    def replay(self):
        """Run on whatever `inputs` hold now and return the graph's own output buffers (no copies):
        for a caller that writes the inputs itself and reads the outputs before the next replay."""
        self.graph.replay()
        return self.outputs
