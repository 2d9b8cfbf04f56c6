"""Which devices' tuned launch configs a CUDA device takes (impl.launch_tables.config_devices): its
own first, then those of a tuned device with its compute capability and multiprocessor count (an
H100 SXM takes the H200's), looked up key by key. Devices are simulated: names and properties
are patched in."""

from __future__ import annotations

import pytest
import torch

from impl import launch_tables, triton_env


@pytest.fixture
def gpu(monkeypatch):
    """Make cuda:0 read as the device named, with the given (capability, SMs)."""
    def as_(name: str, props: tuple):
        monkeypatch.setattr(launch_tables, "device_name", lambda device: name)
        monkeypatch.setattr(launch_tables, "_properties", lambda index: props)
        return torch.device("cuda", 0)
    return as_


@pytest.mark.parametrize("name, props, takes", [
    ("NVIDIA H200", ((9, 0), 132), ("NVIDIA H200",)),
    ("NVIDIA H100 80GB HBM3", ((9, 0), 132), ("NVIDIA H100 80GB HBM3", "NVIDIA H200")),  # one die, other memory
    ("NVIDIA H100 PCIe", ((9, 0), 114), ("NVIDIA H100 PCIe",)),  # fewer SMs: other waves, so the defaults
    ("NVIDIA L40S", ((8, 9), 142), ("NVIDIA L40S",)),
])
def test_an_untuned_device_takes_a_tuned_siblings_configs_after_its_own(gpu, name, props, takes):
    assert launch_tables.config_devices(gpu(name, props)) == takes


def test_the_moe_mla_and_head_tables_take_the_h200s_entries_on_an_h100(gpu):
    from impl.head.fp8_gemv import launch_config as head_launch
    from impl.model.mla_decode import TUNED as MLA_TUNED, launch_config as mla_launch
    from impl.moe.moe_launch_config import MoELaunchConfig, lookup
    device = gpu("NVIDIA H100 80GB HBM3", ((9, 0), 132))
    assert lookup(512, 2560, 768, 8, 1, "mxfp4", device) != MoELaunchConfig()
    assert mla_launch(device) == MLA_TUNED[("NVIDIA H200",)]
    if not triton_env.INTERPRET:  # under the interpreter the head takes its interpreter config
        assert head_launch(157184, 2560, 1, device)[1] == "exact (tuned on NVIDIA H200)"
    other = gpu("NVIDIA H100 PCIe", ((9, 0), 114))
    assert lookup(512, 2560, 768, 8, 1, "mxfp4", other) == MoELaunchConfig()


def test_a_device_tuned_for_one_shape_keeps_its_siblings_configs_for_the_others(gpu, monkeypatch):
    """Before: a table holding any entry of the device's own took none of its sibling's, so one
    shape tuned on an H100 sent every other shape back to the defaults."""
    from impl.moe import moe_launch_config
    device = gpu("NVIDIA H100 80GB HBM3", ((9, 0), 132))
    own = moe_launch_config.MoELaunchConfig(gate_up_block_n=16)
    monkeypatch.setitem(moe_launch_config.TUNED, (8, 64, 32, 2, 1, "bf16", "NVIDIA H100 80GB HBM3"), own)
    assert moe_launch_config.lookup(8, 64, 32, 2, 1, "bf16", device) is own
    sibling = moe_launch_config.TUNED[(512, 2560, 768, 8, 1, "mxfp4", "NVIDIA H200")]
    assert moe_launch_config.lookup(512, 2560, 768, 8, 1, "mxfp4", device) is sibling
