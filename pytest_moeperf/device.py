"""Which device the suites run on, and its fingerprint: the key of every frozen baseline."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
from dataclasses import dataclass
from functools import cached_property
from importlib import metadata


def parse_device(value: str) -> str:
    """`auto`, `cpu`, `cuda` or `cuda:N` (validated here; whether it exists is checked on use)."""
    value = value.strip().lower()
    if value in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", value):
        return value
    raise ValueError(f"--moe-device must be auto, cpu, cuda or cuda:N, got {value!r}")


def _cpu_brand() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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

    @cached_property
    def torch_device(self):
        from impl.model.build import resolve_device
        import torch
        if self.spec == "auto":
            return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        return resolve_device(self.spec)

    @property
    def is_cuda(self) -> bool:
        return self.torch_device.type == "cuda"

    @cached_property
    def fingerprint(self) -> dict:
        import torch
        fp = {"torch": torch.__version__, "triton": _triton_version()}
        if self.is_cuda:
            props = torch.cuda.get_device_properties(self.torch_device)
            fp.update(kind="cuda", name=props.name, capability=f"{props.major}.{props.minor}",
                      cuda=torch.version.cuda, driver=_nvidia_driver())
        else:
            fp.update(kind="cpu", name=_cpu_brand(), cores=os.cpu_count(), machine=platform.machine())
        return fp

    @property
    def key(self) -> str:
        """A short stable hash of the whole fingerprint."""
        blob = json.dumps(self.fingerprint, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    @property
    def slug(self) -> str:
        """File-name stem for this device's baselines: the hardware, not the software versions."""
        fp = self.fingerprint
        name = re.sub(r"[^a-z0-9]+", "-", fp["name"].lower()).strip("-")
        return f"cuda-{name}" if fp["kind"] == "cuda" else f"cpu-{name}-{fp['cores']}c"

    def describe(self) -> str:
        fp = self.fingerprint
        if fp["kind"] == "cuda":
            return (f"{fp['name']} (sm {fp['capability']}, driver {fp['driver']}, CUDA {fp['cuda']}), "
                    f"torch {fp['torch']}, triton {fp['triton']}")
        return f"{fp['name']} ({fp['cores']} cores), torch {fp['torch']}, triton {fp['triton']}"


def _nvidia_driver() -> str | None:
    try:
        import subprocess
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None
