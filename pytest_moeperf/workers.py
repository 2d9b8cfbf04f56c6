"""pytest-xdist workers for --moe-bench: one GPU each, their results merged by the controller.

`pytest --moe-bench -n N --moe-device cuda` (or `-n auto`: one worker per visible GPU) gives
worker i the i-th visible GPU through CUDA_VISIBLE_DEVICES, set before CUDA initializes in it,
so a timed test never shares its GPU; correctness tests spread over the workers as xdist
schedules them. A worker gates its own figures (its test fails on a regression, as in one
process) and sends the controller its results, the figures it would freeze and its device's
fingerprint; the controller prints one gate table, writes one report and freezes once per
fingerprint (identical GPUs share one baseline entry, other models are keyed apart), through the
store's locked read-modify-write.

MOEPERF_SIMULATED_GPUS (a comma-separated list of GPU names) is for testing this machinery on a
machine without GPUs: the workers are assigned "GPUs" 0, 1, ... of the list and run on the CPU,
each with its simulated GPU's name in its fingerprint. A worker's GPU is also in its environment
as MOEPERF_WORKER_GPU, for tests to read.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict

SIMULATED_GPUS_ENV = "MOEPERF_SIMULATED_GPUS"
WORKER_GPU_ENV = "MOEPERF_WORKER_GPU"
WORKER_GPU_KEY = "moeperf_gpu"  # xdist workerinput: the GPU the controller gave this worker
OUTPUT_KEY = "moeperf"          # xdist workeroutput: what the worker sends back


def simulated_gpus(env=os.environ) -> list[str]:
    return [g.strip() for g in env.get(SIMULATED_GPUS_ENV, "").split(",") if g.strip()]


def visible_gpus(env=os.environ) -> list[str]:
    """The GPUs a worker may be pinned to: the simulated ones, else CUDA_VISIBLE_DEVICES' entries,
    else the indices of every GPU the driver reports (NVML: the controller creates no context)."""
    sim = simulated_gpus(env)
    if sim:
        return [str(i) for i in range(len(sim))]
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip()]
    import torch
    return [str(i) for i in range(torch.cuda.device_count())]


def parse_worker_gpus(workers: int, device: str, gpus: list[str], simulated: bool = False) -> list[str]:
    """The GPU of each of the `workers` xdist workers of a --moe-bench run: the first `workers`
    of `gpus`. A run that would put two timing workers on one device is a usage error."""
    if not simulated and (device == "cpu" or (device == "auto" and not gpus)):
        raise ValueError("--moe-bench with -n needs --moe-device cuda: CPU workers would time against each other on "
                         "the same cores (drop -n to time on the CPU)")
    if device.startswith("cuda:"):
        raise ValueError(f"--moe-bench with -n pins one GPU per worker: use --moe-device cuda, not {device!r} "
                         "(CUDA_VISIBLE_DEVICES chooses the GPUs)")
    if not gpus:
        raise ValueError("--moe-bench with -n: no GPU is visible (CUDA_VISIBLE_DEVICES or the driver lists none)")
    if workers > len(gpus):
        raise ValueError(f"--moe-bench -n {workers}: {len(gpus)} GPU(s) visible ({', '.join(gpus)}); timed tests "
                         f"must not share a GPU: use -n {len(gpus)} or -n auto")
    return gpus[:workers]


def worker_index(worker_id: str) -> int:
    """xdist's worker id "gwN" -> N."""
    if not worker_id.startswith("gw") or not worker_id[2:].isdigit():
        raise ValueError(f"unexpected pytest-xdist worker id {worker_id!r} (expected gwN)")
    return int(worker_id[2:])


def simulated_name(gpu: str, env=os.environ) -> str | None:
    """The name of simulated GPU `gpu` (its index in MOEPERF_SIMULATED_GPUS); None in a real run."""
    sim = simulated_gpus(env)
    return sim[int(gpu)] if sim else None


def pin_worker_gpu(gpu: str, env=os.environ) -> None:
    """Make `gpu` the only GPU this worker process sees; CUDA must not be initialized yet."""
    env[WORKER_GPU_ENV] = gpu
    if simulated_gpus(env):
        return
    import torch
    if torch.cuda.is_initialized():
        raise RuntimeError(f"CUDA was initialized in this pytest-xdist worker before it could be pinned to GPU "
                           f"{gpu}: something imported at plugin load time touched the GPU")
    env["CUDA_VISIBLE_DEVICES"] = gpu


def worker_payload(session, gpu: str) -> dict | None:
    """What a worker sends back of what it measured since it last sent (None: nothing new), as
    plain JSON types: execnet carries only builtin types (a fingerprint's torch version is a str
    subclass). Sent with each test's report, so what a worker measured reaches the controller
    even when the worker crashes or the run is stopped later."""
    results = session.results[session.sent_results:]
    to_freeze = {mid: m for mid, m in session.to_freeze.items() if session.sent_freezes.get(mid) is not m}
    if not results and not to_freeze:
        return None
    session.sent_results = len(session.results)
    session.sent_freezes.update(to_freeze)
    return json.loads(json.dumps({"gpu": gpu, "fingerprint": session.device.fingerprint, "slug": session.device.slug,
            "device": session.device.describe(),
            "results": [asdict(r) for r in results],
            "to_freeze": {mid: asdict(m) for mid, m in to_freeze.items()}}, default=str))


def merge_payload(session, payload: dict, worker: str) -> None:
    """Add what worker `worker` (its xdist id) sent to the controller's session: one entry per
    worker in `session.workers`, however many times it sent."""
    from pytest_moeperf.baselines import FrozenMetric
    from pytest_moeperf.gate import GateResult
    for raw in payload["results"]:
        result = GateResult(**raw)
        result.gpu = payload["gpu"]
        session.results.append(result)
    entry = next((w for w in session.workers if w["worker"] == worker), None)
    if entry is None:
        entry = {"worker": worker, **{k: payload[k] for k in ("gpu", "fingerprint", "slug", "device")},
                 "to_freeze": {}}
        session.workers.append(entry)
    entry["to_freeze"].update({mid: FrozenMetric(**m) for mid, m in payload["to_freeze"].items()})
