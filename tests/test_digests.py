"""What a frozen figure was measured on, by content (impl.digests.content_digest, folder_digest): a
prompts file or checkpoint replaced at the same path is told apart, an unchanged one is not, and a
run's configuration names a checkpoint folder's digest (a preset's name stands for itself)."""

from __future__ import annotations

from pathlib import Path

from impl import digests
from moe_harness.options import MoeOptions
from moe_harness.state import MoeRun
from pytest_moeperf.options import Options
from pytest_moeperf.session import MoePerfSession


def test_a_file_is_named_by_its_contents_not_its_path(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b" / "a.jsonl"
    b.parent.mkdir()
    a.write_text('{"prompt": "1 + 1 ="}\n')
    b.write_text('{"prompt": "1 + 1 ="}\n')
    first = digests.content_digest([a])
    assert first == digests.content_digest([b]) and len(first) == 12
    a.write_text('{"prompt": "1 + 2 ="}\n')
    assert digests.content_digest([a]) != first


def test_a_large_shard_is_named_by_its_size_and_edges(tmp_path, monkeypatch):
    """A shard past WHOLE_BYTES is read at its first and last EDGE_BYTES only (a 100 GB checkpoint
    is not read whole at every run): a change there, or in its size, is seen."""
    monkeypatch.setattr(digests, "WHOLE_BYTES", 64)
    monkeypatch.setattr(digests, "EDGE_BYTES", 16)
    shard = tmp_path / "model.safetensors"
    data = bytearray(range(200))
    shard.write_bytes(bytes(data))
    first = digests.content_digest([shard])
    for at in (3, 190):
        changed = bytearray(data)
        changed[at] ^= 1
        shard.write_bytes(bytes(changed))
        assert digests.content_digest([shard]) != first, at
    shard.write_bytes(bytes(data) + b"\0")
    assert digests.content_digest([shard]) != first
    changed = bytearray(data)
    changed[100] ^= 1  # the middle: not read
    shard.write_bytes(bytes(changed))
    assert digests.content_digest([shard]) == first


def _run_config(model: str) -> dict:
    """The MoE harness's part of a CPU run's configuration, with --moe-model `model`."""
    core = MoePerfSession(Options(bench=True, device="cpu", baselines=Path("b"), freeze=False, report=None, samples=5))
    return MoeRun(MoeOptions(model=model, backend="auto", head="bf16"), core).run_config()


def test_a_checkpoint_folder_is_part_of_what_its_figures_are_frozen_under(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "qwen3_moe"}')
    (folder / "model.safetensors").write_bytes(b"weights")
    before = _run_config(str(folder))
    assert before["checkpoint"] == digests.folder_digest(folder)
    (folder / "model.safetensors").write_bytes(b"retrained")
    retrained = _run_config(str(folder))["checkpoint"]
    assert retrained != before["checkpoint"]
    (folder / "README.md").write_text("notes beside the weights")  # not what the figures depend on
    assert _run_config(str(folder))["checkpoint"] == retrained
    assert "checkpoint" not in _run_config("tiny-gsm")
