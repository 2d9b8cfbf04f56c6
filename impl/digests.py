"""Files named by their contents: what a frozen figure was measured on (a checkpoint folder, a
prompts file), so that one replaced at the same path is another configuration, not a regression."""

from __future__ import annotations

import hashlib
from pathlib import Path

# Files up to this size are hashed whole; a larger one (a checkpoint shard) by its size and its
# first and last EDGE_BYTES: a retrained or re-quantized shard changes those too, and reading a
# 100 GB checkpoint whole at every run would cost minutes.
WHOLE_BYTES = 16 << 20
EDGE_BYTES = 1 << 20


def content_digest(paths) -> str:
    """12 hex digits of sha256 over each file's name, size and bytes (see WHOLE_BYTES), in the
    order given: what a figure measured on these files is frozen under, so that a file replaced at
    the same path is not gated against figures of its predecessor."""
    h = hashlib.sha256()
    for path in paths:
        path = Path(path)
        size = path.stat().st_size
        h.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            if size <= WHOLE_BYTES:
                h.update(f.read())
            else:
                h.update(f.read(EDGE_BYTES))
                f.seek(size - EDGE_BYTES)
                h.update(f.read(EDGE_BYTES))
    return h.hexdigest()[:12]


# What of a checkpoint folder decides its figures: configs, index and tokenizer files, and the
# weights; not a README or a lock file beside them.
CHECKPOINT_SUFFIXES = (".json", ".safetensors", ".model", ".txt", ".tiktoken")


def folder_digest(folder) -> str:
    """content_digest of a checkpoint folder's files (CHECKPOINT_SUFFIXES, directly in it), by name."""
    return content_digest(sorted(p for p in Path(folder).iterdir()
                                 if p.is_file() and p.suffix in CHECKPOINT_SUFFIXES))
