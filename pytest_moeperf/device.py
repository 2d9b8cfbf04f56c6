"""Which device the suites run on, and its fingerprint: the key of every frozen baseline.

A fingerprint (schema 2) names what decides a measurement's speed:
- CPU: vendor, model name, family/model/stepping (x86; implementer/part/variant/revision on Arm),
  the ISA level torch's kernels use (`torch.backends.cpu.get_cpu_capability()`), usable cores,
  torch's threads, L2 and L3 sizes, the architecture, and the torch and triton versions. "AMD EPYC,
  2 cores" alone was not enough: two such VMs (family 25 model 1, AVX2; family 25 model 17,
  AVX512) differ 3.5x in decode speed.
- CUDA: GPU name, compute capability, SM count, memory, CUDA, driver, torch and triton versions.

Absolute figures are gated only against the exact fingerprint. Figures measured side by side in
one run (ratios) also travel to machines of the same *class* (`class_of`): on a CPU the same
vendor, architecture, ISA level, core count and torch; on a GPU the same model, capability, torch
and triton. The vendor is there because a ratio of two configurations that run different kernels
moves with the cores: the A/B ladder's +mtp over baseline (an emulated FP8 head and 4-token
verify steps against bf16 one-token steps) read 1.148-1.205x on a 2-core AVX512 Intel Xeon
against 1.302x frozen on a 2-core AVX512 AMD EPYC, 8-12% apart, beyond its 10% tolerance
(notes/runs/2026-12-04-cpu-main-job-intel-class.log).

Schema 1 fingerprints (no "schema" field: kind, name, cores or capability/cuda/driver, machine,
torch, triton) stay readable: a CUDA entry of schema 1 still matches a GPU whose schema-1 fields
equal its own (they named the GPU model and its whole software stack), so frozen GPU figures keep
gating; a CPU entry of schema 1 never matches and belongs to no class, because its fields are the
ones shown not to tell machines apart (`schema1_match`).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
from dataclasses import dataclass
from functools import cached_property
from importlib import metadata
from pathlib import Path

SCHEMA = 2
# The fields a schema-1 fingerprint had, per kind (`schema1_match`).
SCHEMA1_FIELDS = {"cuda": ("kind", "name", "capability", "cuda", "driver", "torch", "triton"),
                  "cpu": ("kind", "name", "cores", "machine", "torch", "triton")}
CLASS_FIELDS = {"cpu": ("kind", "vendor", "machine", "isa", "cores", "torch"),
                "cuda": ("kind", "name", "capability", "torch", "triton")}


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def _int(value: str | None) -> int | str | None:
    if value is None:
        return None
    try:
        return int(value, 0)
    except ValueError:
        return value


def _cache_kib(level: int) -> int | None:
    """Size of the level-`level` data or unified cache that cpu0 sits behind, in KiB."""
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if int((index / "level").read_text()) != level or (index / "type").read_text().strip() == "Instruction":
                continue
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        m = re.fullmatch(r"(\d+)([KMG]?)", size)
        if m:
            kib = {"": 1 / 1024, "K": 1, "M": 1024, "G": 1024 * 1024}[m.group(2)]
            return int(int(m.group(1)) * kib)
    return None


def _cores() -> int | None:
    """Cores this process may run on (a container's or taskset's limit, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def _torch():
    """torch, or None where it cannot be imported: the gate core also times plain Python, and then
    a fingerprint says so (its torch fields None)."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def cpu_fingerprint() -> dict:
    torch = _torch()
    info = _cpuinfo()
    fp = {"schema": SCHEMA, "kind": "cpu",
          "vendor": info.get("vendor_id") or info.get("CPU implementer"),
          "name": info.get("model name") or platform.processor() or platform.machine()}
    if "cpu family" in info:  # x86
        fp.update(family=_int(info.get("cpu family")), model=_int(info.get("model")),
                  stepping=_int(info.get("stepping")))
    else:  # Arm and others: what the kernel reports, if anything
        fp.update(family=_int(info.get("CPU architecture")), model=_int(info.get("CPU part")),
                  stepping=_int(info.get("CPU variant")), revision=_int(info.get("CPU revision")))
    fp.update(isa=torch.backends.cpu.get_cpu_capability() if torch else None, cores=_cores(),
              threads=torch.get_num_threads() if torch else None, l2_kib=_cache_kib(2), l3_kib=_cache_kib(3),
              machine=platform.machine(), torch=torch.__version__ if torch else None, triton=_triton_version())
    return fp


def cuda_fingerprint(device) -> dict:
    import torch
    props = torch.cuda.get_device_properties(device)
    return {"schema": SCHEMA, "kind": "cuda", "name": props.name, "capability": f"{props.major}.{props.minor}",
            "sms": props.multi_processor_count, "memory_gib": round(props.total_memory / 2**30),
            "cuda": torch.version.cuda, "driver": _nvidia_driver(), "torch": torch.__version__,
            "triton": _triton_version()}


def class_of(fingerprint: dict) -> dict | None:
    """The fields that machines gating each other's side-by-side ratios share; None for a
    fingerprint that cannot be placed in a class (a schema-1 CPU one has no ISA level)."""
    fields = CLASS_FIELDS.get(fingerprint.get("kind"))
    if fields is None or any(fingerprint.get(f) is None for f in fields):
        return None
    return {f: fingerprint[f] for f in fields}


def schema1_match(entry: dict, fingerprint: dict) -> bool:
    """Whether a schema-1 baseline entry's fingerprint is this (schema 2) device's: only for
    CUDA, field by field over the fields schema 1 had."""
    if "schema" in entry or entry.get("kind") != "cuda" or fingerprint.get("kind") != "cuda":
        return False
    fields = SCHEMA1_FIELDS["cuda"]
    return set(entry) == set(fields) and all(entry[f] == fingerprint.get(f) for f in fields)


def short_key(fingerprint: dict) -> str:
    """A short stable hash of a whole fingerprint."""
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:12]


def _triton_version() -> str | None:
    # From the package metadata: importing triton costs seconds and cannot be undone in-process.
    try:
        return metadata.version("triton")
    except metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class DeviceInfo:
    """The resolved torch device plus the facts a measurement depends on."""

    spec: str
    simulated_gpu: str | None = None  # a worker of a simulated multi-GPU run (pytest_moeperf.workers)

    @cached_property
    def torch_device(self):
        import torch
        if self.spec == "auto":
            return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        return resolve_device(self.spec)

    @cached_property
    def is_cuda(self) -> bool:
        if self.spec == "cpu" or (self.spec == "auto" and _torch() is None):  # no torch: plain Python on the CPU
            return False
        return self.torch_device.type == "cuda"

    @cached_property
    def fingerprint(self) -> dict:
        fp = cuda_fingerprint(self.torch_device) if self.is_cuda else cpu_fingerprint()
        return fp if self.simulated_gpu is None else {**fp, "simulated_gpu": self.simulated_gpu}

    @property
    def key(self) -> str:
        return short_key(self.fingerprint)

    @property
    def slug(self) -> str:
        """File-name stem for this device's baselines: the hardware's name, not its details."""
        fp = self.fingerprint
        name = re.sub(r"[^a-z0-9]+", "-", fp["name"].lower()).strip("-")
        return f"cuda-{name}" if fp["kind"] == "cuda" else f"cpu-{name}-{fp['cores']}c"

    def describe(self) -> str:
        return describe(self.fingerprint)


def resolve_device(spec):
    """`spec` (cpu, cuda, cuda:N, or a torch.device) as a torch.device that exists on this machine;
    ValueError naming what is missing otherwise."""
    import torch
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ValueError(f"unsupported device {spec!r}; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {spec!r} requested but CUDA is not available on this machine")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {spec!r} requested but only {torch.cuda.device_count()} CUDA device(s) exist")
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise ValueError(f"unsupported device {spec!r}; use cpu, cuda or cuda:N")
    return device


def describe(fp: dict) -> str:
    """One line for a fingerprint of either schema."""
    soft = f"torch {fp.get('torch')}, triton {fp.get('triton')}"
    if fp.get("kind") == "cuda":
        extra = f", {fp['sms']} SMs, {fp['memory_gib']} GiB" if "sms" in fp else ""
        return f"{fp['name']} (sm {fp['capability']}{extra}, driver {fp['driver']}, CUDA {fp['cuda']}), {soft}"
    if "schema" not in fp:
        return f"{fp.get('name')} ({fp.get('cores')} cores; schema-1 fingerprint), {soft}"
    caches = ", ".join(f"L{n} {fp[f'l{n}_kib'] // 1024} MiB" if fp[f"l{n}_kib"] >= 1024 else f"L{n} {fp[f'l{n}_kib']} KiB"
                       for n in (2, 3) if fp.get(f"l{n}_kib"))
    return (f"{fp['name']} ({fp['vendor']} family {fp['family']} model {fp['model']} stepping {fp['stepping']}, "
            f"{fp['isa']}, {fp['cores']} cores, {fp['threads']} threads{', ' + caches if caches else ''}), {soft}")


def _nvidia_driver() -> str | None:
    try:
        import subprocess
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None
