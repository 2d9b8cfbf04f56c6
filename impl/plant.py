"""Planted slowdowns: a known regression put into a backend, so the gate can be shown to catch it.

A plant names a registered backend (`kind`, `name`) and a fraction f. `activate` puts a wrapped
copy of that backend in the registry (impl.backends) in its place, `deactivate` puts the original
back. The decoder kinds are planted the same way: the decode runners (impl.decode_runner) call
their steps through the registry, so nothing in a hot path knows about plants.

Every call of a planted backend takes (1 + f) times as long as it did: after the call, the host
(CPU) or the device (CUDA) waits for f times the call's own elapsed time. On a GPU this is two
tiny kernels around the call: one stamps the device's global timer before it, one spins after it
until f times the stamped interval has passed, less the pair's own measured cost. Both run on the
current stream, so a plant is captured into CUDA graphs with the work it slows and needs no host
sync; each call's slowdown follows that call's own time, whatever its shape. Planted calls record
a `planted_slowdown` provenance event.

Plants exist for gate-trust runs (`--moe-plant`, `scripts/gate_trust.py`): they are active only
between `activate` and `deactivate`; what looked a backend up before `activate` keeps the original.
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass
from typing import Callable

import torch

from impl import backends

SPIN_CALIBRATION_CALLS = 64  # empty stamp+spin pairs timed to learn what the pair itself costs


@dataclass(frozen=True)
class Plant:
    kind: str
    name: str
    fraction: float

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}+{self.fraction:.0%}"


_SPEC = re.compile(r"(?P<kind>[a-z]+)(?::(?P<name>[\w.+-]+))?=(?P<fraction>[0-9.eE+-]+)")


def parse_plants(value: str, defaults: dict[str, str]) -> tuple[Plant, ...]:
    """`KIND[:NAME]=FRACTION[,...]`, e.g. `moe=0.1` or `head:fp8-triton=0.1,decoder:mtp=0.1`.
    NAME defaults to `defaults[KIND]` (the backend under test); each (kind, name) must be a
    registered backend and appear once; FRACTION is in (0, 10]. Errors name the offending part;
    the caller adds where the spec came from (the plugin: its option)."""
    plants = []
    for part in (p.strip() for p in value.split(",")):
        m = _SPEC.fullmatch(part)
        if not m:
            raise ValueError(f"{part!r} is not KIND[:NAME]=FRACTION (e.g. moe=0.1, decoder:mtp=0.1)")
        kind, name = m["kind"], m["name"] or defaults.get(m["kind"])
        if kind not in backends.KINDS:
            raise ValueError(f"unknown backend kind {kind!r} in {part!r}; expected one of {backends.KINDS}")
        if name is None:
            raise ValueError(f"{part!r} needs a backend name ({kind}:NAME=FRACTION); "
                             f"{kind} backends: {backends.available(kind)}")
        backends.get(kind, name)  # an unknown name: ValueError naming the registered ones
        try:
            fraction = float(m["fraction"])
        except ValueError:
            fraction = float("nan")
        if not 0 < fraction <= 10:
            raise ValueError(f"the slowdown fraction in {part!r} must be in (0, 10], got {m['fraction']}")
        if any((p.kind, p.name) == (kind, name) for p in plants):
            raise ValueError(f"{kind}:{name} is planted twice")
        plants.append(Plant(kind, name, fraction))
    return tuple(plants)


_active: dict[tuple[str, str], Plant] = {}
_slots: dict[torch.device, torch.Tensor] = {}  # one int64 stamp per plant, per CUDA device
_overhead_ns: dict[torch.device, int] = {}
_originals: dict[tuple[str, str], backends.Backend] = {}  # the registered backends the plants replace


def activate(plants: tuple[Plant, ...], device: torch.device | None = None) -> None:
    """Replace each planted backend in the registry by its slowed copy (earlier plants are lifted
    first); on a CUDA `device`, compile and calibrate the spin there now (not inside a graph
    capture)."""
    deactivate()
    _active.update({(p.kind, p.name): p for p in plants})
    for plant in plants:
        backend = backends.get(plant.kind, plant.name)
        slowed = {"fn": _slowed(plant, backend.fn)}
        if backend.layer is not None:
            slowed["layer"] = _slowed(plant, backend.layer)
        _originals[(plant.kind, plant.name)] = backend
        backends.register(dataclasses.replace(backend, **slowed), replace=True)
    if device is not None and device.type == "cuda" and plants:
        _calibrate(device)


def deactivate() -> None:
    """Put the original backends back in the registry."""
    for backend in _originals.values():
        backends.register(backend, replace=True)
    _originals.clear()
    _active.clear()


def active() -> tuple[Plant, ...]:
    return tuple(_active.values())


def _slowed(plant: Plant, fn: Callable) -> Callable:
    def planted(*args, **kwargs):
        token = _begin(plant, _device_of(args, kwargs))
        out = fn(*args, **kwargs)
        _end(plant, token)
        return out

    planted.__wrapped__ = fn
    return planted


def _device_of(args, kwargs) -> torch.device:
    """The device of the first tensor among the arguments, else among their attributes (a decoder
    step's state object)."""
    values = (*args, *kwargs.values())
    for a in (*values, *(v for a in values if hasattr(a, "__dict__") for v in vars(a).values())):
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device("cpu")


def _index(plant: Plant) -> int:
    return list(_active).index((plant.kind, plant.name))


def _begin(plant: Plant, device: torch.device):
    backends.note(plant.kind, plant.name, "planted_slowdown", fraction=plant.fraction)
    if device.type != "cuda":
        return device, time.perf_counter()
    slot = _slot(device)[_index(plant):]
    kernels()[0][(1,)](slot)
    return device, slot


def _end(plant: Plant, token) -> None:
    device, mark = token
    if device.type != "cuda":
        until = mark + (1 + plant.fraction) * (time.perf_counter() - mark)
        while time.perf_counter() < until:  # a busy wait: sleeping would hand the core to other work
            pass
        return
    kernels()[1][(1,)](mark, plant.fraction, _overhead_ns.get(_key(device), 0))


def _key(device: torch.device) -> torch.device:
    """cuda and cuda:0 are one device (the plugin may name it either way)."""
    return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())


def _slot(device: torch.device) -> torch.Tensor:
    device = _key(device)
    if device not in _slots:
        _slots[device] = torch.zeros(max(len(_active), 1), dtype=torch.int64, device=device)
    return _slots[device]


def _calibrate(device: torch.device) -> None:
    """What an empty stamp+spin pair costs inside a CUDA graph on `device` (the spin subtracts it,
    so that a planted call's slowdown is f times its time, not f plus two launches)."""
    from impl.graphs import capture_graph
    device = _key(device)
    stamp, spin = kernels()
    slot = _slot(device)
    with torch.cuda.device(device):
        graph = capture_graph([lambda: (stamp[(1,)](slot), spin[(1,)](slot, 0.0, 0))
                               for _ in range(SPIN_CALIBRATION_CALLS)])
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(5):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e6 / SPIN_CALIBRATION_CALLS)
    _overhead_ns[device] = int(sorted(times)[len(times) // 2])


_KERNELS = None


def kernels():
    """(stamp, spin) Triton kernels, built on first CUDA use (the CPU path never imports Triton)."""
    global _KERNELS
    if _KERNELS is None:
        from impl.triton_env import tl, triton
        from triton.language.extra.cuda import globaltimer

        @triton.jit
        def plant_stamp_kernel(stamp_ptr):
            tl.store(stamp_ptr, globaltimer())

        @triton.jit
        def plant_spin_kernel(stamp_ptr, fraction, overhead_ns):
            start = tl.load(stamp_ptr, volatile=True)
            now = globaltimer()
            until = now + ((now - start).to(tl.float32) * fraction).to(tl.int64) - overhead_ns
            while now < until:
                now = globaltimer()

        _KERNELS = (plant_stamp_kernel, plant_spin_kernel)
    return _KERNELS


def overhead_ns(device: torch.device) -> int | None:
    """The calibrated cost of an empty stamp+spin pair on `device` (None before calibration)."""
    return _overhead_ns.get(_key(device)) if device.type == "cuda" else None
