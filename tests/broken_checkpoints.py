"""Checkpoints broken on purpose, for negative controls against real servers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def scrambled_nextn_copy(src: Path, dst: Path, seed: int = 0) -> Path:
    """A copy of checkpoint `src` at `dst` whose NEXTN (MTP) layer's input projection has its
    output rows permuted: the target model is untouched (its answers are the same), the draft
    still runs and shares the target's head, and its proposals are almost never accepted."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, dst / f.name)
    layer = json.loads((src / "config.json").read_text())["num_hidden_layers"]  # the NEXTN layer follows the last
    tensors = load_file(src / "model.safetensors")
    key = f"model.layers.{layer}.eh_proj.weight"
    w = tensors[key]
    tensors[key] = w[torch.randperm(w.shape[0], generator=torch.Generator().manual_seed(seed))].contiguous()
    save_file(tensors, dst / "model.safetensors")
    return dst
