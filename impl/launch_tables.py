"""Tables of tuned launch configs, the one mechanism behind every kernel's: the MoE layer's
(impl/moe/launch_config.py), MLA decode's (impl/model/mla_decode.py) and the FP8 head's
(impl/head/gemv_config.py).

- `LaunchTable`: a kernel's table file, a JSON list of entries
  {"key": {field: value, ...}, "config": {field: value, ...}} with an optional "measured" (what
  chose the entry), beside the kernel. The key's fields are the table's `key_fields`, the last
  "device" (a CUDA device name); the config's, those of the table's config dataclass (a field left
  out takes its default). Reading checks every entry (`load`); writing merges entries in and
  replaces the file atomically (`save`).
- `check_power_of_two`: the tile-size check of the config dataclasses.
- The sibling policy (`config_devices`): the devices whose entries a device takes, in order;
  `first_entry` looks a key up under each in turn.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

from pytest_moeperf.files import atomic_write_text

__all__ = ["TUNED_ON", "LaunchTable", "check_power_of_two", "config_devices", "device_name", "first_entry"]

C = TypeVar("C")
ENTRY_FIELDS = ("key", "config", "measured")


def check_power_of_two(config: Any, names: Sequence[str], least: int = 1, why: str = "") -> None:
    """Raise ValueError unless each field `names` of `config` is a power of two >= `least`."""
    for name in names:
        v = getattr(config, name)
        if v < least or v & (v - 1):
            bound = f" >= {least}" if least > 1 else ""
            raise ValueError(f"{type(config).__name__}.{name} must be a power of two{bound}"
                             f"{f' ({why})' if why else ''}, got {v}")


@dataclass(frozen=True)
class LaunchTable(Generic[C]):
    """One kernel's tuned launch configs: the file at `path`, entries keyed by `key_fields` (the
    last "device"), configs of `config_type`; `what` names the kernel in errors."""
    path: Path
    config_type: type[C]
    key_fields: tuple[str, ...]
    what: str

    def __post_init__(self) -> None:
        if not self.key_fields or self.key_fields[-1] != "device":
            raise ValueError(f"{self.what}: a table's last key field is 'device', got {self.key_fields}")

    def load(self) -> dict[tuple, C]:
        """{key tuple: config} from the file ({} where there is none)."""
        return {key: cfg for key, (cfg, _) in self._entries().items()}

    def save(self, new: Mapping[tuple, C], measured: str | None = None) -> None:
        """Merge `new` ({key tuple: config}, each noted with `measured` where given) into the file,
        keeping the other entries, sorted by key; atomically (a tuning cut short mid-write leaves
        the old file). A file that does not read is left as it is."""
        entries = self._entries()
        for key, cfg in new.items():
            self._check_new(key, cfg)
            entries[tuple(key)] = (cfg, measured)
        out = [{"key": dict(zip(self.key_fields, key)), "config": dataclasses.asdict(cfg),
                **({"measured": note} if note else {})} for key, (cfg, note) in sorted(entries.items())]
        atomic_write_text(self.path, json.dumps(out, indent=1) + "\n")

    def _check_new(self, key: tuple, cfg: C) -> None:
        if len(key) != len(self.key_fields) or not isinstance(key[-1], str):
            raise ValueError(f"{self.path}: a {self.what} key is ({', '.join(self.key_fields)}), got {key!r}")
        if not isinstance(cfg, self.config_type):
            raise TypeError(f"{self.path}: a {self.what} config is a {self.config_type.__name__}, got {cfg!r}")

    def _entries(self) -> dict[tuple, tuple[C, str | None]]:
        """{key tuple: (config, measured)}, every entry checked; an error names the file and the
        entry's key."""
        if not self.path.exists():
            return {}
        try:
            entries = json.loads(self.path.read_text())
        except ValueError as e:
            raise self._malformed(f"not JSON: {e}") from None
        if not isinstance(entries, list):
            raise self._malformed(f"a list of entries, got {type(entries).__name__}")
        out: dict[tuple, tuple[C, str | None]] = {}
        for i, entry in enumerate(entries):
            key_text = json.dumps(entry.get("key")) if isinstance(entry, dict) else "?"
            try:
                key, cfg, measured = self._entry(entry)
                if key in out:
                    raise ValueError("a second entry of this key")
            except (ValueError, TypeError) as e:
                raise self._malformed(f"entry {i}, key {key_text}: {e}") from None
            out[key] = (cfg, measured)
        return out

    def _entry(self, entry: Any) -> tuple[tuple, C, str | None]:
        if not isinstance(entry, dict) or not {"key", "config"} <= entry.keys():
            raise ValueError('an entry is {"key": {...}, "config": {...}}')
        if unknown := sorted(entry.keys() - set(ENTRY_FIELDS)):
            raise ValueError(f"unknown entry fields {unknown} (of {list(ENTRY_FIELDS)})")
        key, config, measured = entry["key"], entry["config"], entry.get("measured")
        if not isinstance(key, dict) or not isinstance(config, dict):
            raise ValueError("key and config are objects")
        if key.keys() != set(self.key_fields):
            raise ValueError(f"key fields are {list(self.key_fields)}, got {sorted(key)}")
        values = tuple(key[f] for f in self.key_fields)
        for field, v in zip(self.key_fields, values):
            if isinstance(v, bool) or not isinstance(v, str if field == "device" else (int, str)):
                raise ValueError(f"key field {field!r} is {'a name' if field == 'device' else 'a number or name'}, "
                                 f"got {v!r}")
        if measured is not None and not isinstance(measured, str):
            raise ValueError(f"measured is text, got {measured!r}")
        return values, self.config_type(**config), measured

    def _malformed(self, why: str) -> ValueError:
        return ValueError(f"{self.path}: malformed tuned {self.what} configs ({why})")


@functools.lru_cache(maxsize=None)
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_name(device: torch.device) -> str:
    """The name tuned launch configs are keyed by: the CUDA device's, or "cpu" (cached: kernels
    look their configs up on every call)."""
    if device.type != "cuda":
        return "cpu"
    return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())


# The devices launch configs were tuned on, by what decides which tiles and launches are fastest
# for a memory-bound kernel of this package: the multiprocessor design (compute capability) and
# count, which set the programs in flight, the registers and shared memory each gets and the
# waves. An untuned device with both the same takes that device's configs (an H100 SXM, 9.0 and
# 132 SMs, the H200's: one GH100 die with other memory); any other device, the defaults.
TUNED_ON = {"NVIDIA H200": ((9, 0), 132)}


@functools.lru_cache(maxsize=None)
def _properties(index: int) -> tuple[tuple[int, int], int]:
    p = torch.cuda.get_device_properties(index)
    return (p.major, p.minor), p.multi_processor_count


def config_devices(device: torch.device) -> tuple[str, ...]:
    """The device names whose tuned launch configs `device` takes, in order: its own, then each
    device in TUNED_ON with its compute capability and multiprocessor count. A table looks a key
    up under each in turn (`first_entry`), so a device tuned for some shapes keeps a sibling's for
    the others."""
    name = device_name(device)
    if device.type != "cuda":
        return (name,)
    mine = _properties(device.index if device.index is not None else torch.cuda.current_device())
    return (name, *sorted(other for other, props in TUNED_ON.items() if props == mine and other != name))


def first_entry(table: Mapping[tuple, C], shapes: Sequence[tuple],
                devices: Sequence[str]) -> tuple[C, int, int] | None:
    """The first entry (*shape, device) of `table`, device by device in order (`config_devices`)
    and under each the shapes in order: (config, the shape's index, the device's index), or None."""
    for d, device in enumerate(devices):
        for s, shape in enumerate(shapes):
            if (key := (*shape, device)) in table:
                return table[key], s, d
    return None
