"""GPU timing helpers shared by the GPU benchmark suites and scripts/gpu: the device's copy
bandwidth (the denominator of every bytes floor) and the median time per call of work replayed
from a CUDA graph. Both take medians of `triton.testing.do_bench` (warm-up and rep in ms, as it
takes them); Triton is imported on first use, so importing this module needs neither it nor a GPU.
"""

from __future__ import annotations

from typing import Callable

import torch

from impl.graphs import capture_graph

COPY_BYTES = 4 << 30  # 4 GiB: long enough that launch and ramp are lost in the stream


def copy_bandwidth(device: torch.device | str = "cuda", nbytes: int = COPY_BYTES, warmup: int = 50,
                   rep: int = 300) -> float:
    """Bytes read + written per second by a device-to-device copy of `nbytes` (median): the
    ceiling of batch-1 decode, which streams its weights once per token. A kernel that only reads
    can go slightly past it (the copy's mix of reads and writes is a little slower than reads)."""
    import triton.testing
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.random_(0, 255)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=warmup, rep=rep, return_mode="median")
    src = dst = None  # the buffers go back to the device, not to torch's cache
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3)


def graph_us(calls: list[Callable[[], object]], warmup: int = 25, rep: int = 200) -> float:
    """Median microseconds per call of `calls`, captured in order in one CUDA graph (pass the same
    call several times, `[fn] * n`, to time one call replayed n times per replay)."""
    import triton.testing
    graph = capture_graph(calls)
    ms = triton.testing.do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median")
    return ms * 1e3 / len(calls)


def interleaved_replay_us(graphs: dict[str, "torch.cuda.CUDAGraph"], rounds: int = 5, rep: int = 100,
                          warmup: int = 25) -> dict[str, list[float]]:
    """Per graph, `rounds` medians of its replay time in microseconds, the graphs taking turns
    round by round (A B C, A B C, ...): drift of clocks or heat falls on all of them alike, so
    round-by-round differences between two graphs are paired."""
    import triton.testing
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    out: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, graph in graphs.items():
            out[name].append(1e3 * triton.testing.do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median"))
    return out
