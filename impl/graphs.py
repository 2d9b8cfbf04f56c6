"""CUDA graphs for launch-bound work: a decode step of a small model is dozens of tiny kernels,
and replaying them from one graph removes the host's launch gaps between them."""

from __future__ import annotations

import gc
from typing import Callable

import torch


def capture_graph(calls: list[Callable[[], object]], pool=None) -> "torch.cuda.CUDAGraph":
    """One CUDA graph replaying `calls` in order (warmed up first on a side stream, as capture
    requires; the warm-up runs each call twice, so calls that update state in place advance it).
    `pool` (torch.cuda.graph_pool_handle()) shares one memory pool between graphs that are never
    replayed at the same time, so their intermediates take the largest one's memory, not the sum."""
    for fn in calls:
        fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    # Python's collector is kept out of the capture: an earlier graph left unreachable (a cycle
    # through its step's closure) freed mid-capture is the likely cause of the "operation failed
    # due to a previous error during capture" a fourth row's capture in one test process hit on
    # the H200; collecting first and pausing the collector, it has not recurred.
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            for fn in calls:
                fn()
    finally:
        if collecting:
            gc.enable()
    torch.cuda.synchronize()
    return graph


class StepGraph:
    """`step()`, which must read and write only persistent buffers, replayed from a CUDA graph on
    a CUDA device and called directly elsewhere. Capturing runs the step a few times: reset the
    state it advances before using the result."""

    def __init__(self, step: Callable[[], object], device: torch.device, pool=None) -> None:
        self.step = step
        with torch.inference_mode():
            self.graph = capture_graph([step], pool) if device.type == "cuda" else None

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            with torch.inference_mode():
                self.step()
