"""The tuned launch-config tables (impl.launch_tables): every kernel's lookup gives, for every
committed key, what it gave before the tables shared one mechanism (launch_lookups_fe488c8.json,
computed at fe488c8 with each device simulated); and the one validator refuses a bad file naming
the file and the entry's key."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from impl import launch_tables
from impl.head import gemv_config
from impl.launch_tables import LaunchTable, check_power_of_two
from impl.model import mla_decode
from impl.moe import moe_launch_config

BEFORE = json.loads((Path(__file__).with_name("launch_lookups_fe488c8.json")).read_text())
CONFIGS = BEFORE["configs"]


def simulated(monkeypatch, name: str, props) -> torch.device:
    """cuda:0 read as the device `name` with (capability, SMs) `props`; the CPU where props is None."""
    if props is None:
        return torch.device("cpu")
    monkeypatch.setattr(launch_tables, "device_name", lambda device: name)
    monkeypatch.setattr(launch_tables, "_properties", lambda index: (tuple(props[0]), props[1]))
    return torch.device("cuda", 0)


def rows(kind: str, name: str) -> list[list]:
    return [r for r in BEFORE[kind]["rows"] if r[0] == name]


def test_the_tables_hold_the_same_keys():
    """Every key committed before, no other; the head's device defaults as (ANY, ANY, bucket, device)."""
    keys = BEFORE["tuned_keys"]
    assert sorted(map(list, moe_launch_config.TUNED)) == keys["moe"]
    assert sorted(map(list, mla_decode.TUNED)) == keys["mla"]
    any_ = gemv_config.ANY
    assert sorted(map(list, gemv_config.TUNED)) == sorted(
        keys["head"] + [[any_, any_, *k] for k in keys["head_device_defaults"]])


@pytest.mark.parametrize("name, props", BEFORE["devices"], ids=[d[0] for d in BEFORE["devices"]])
def test_every_lookup_gives_the_config_it_gave_before(monkeypatch, name, props):
    device = simulated(monkeypatch, name, props)
    moe = rows("moe", name)
    assert len(moe) == 16 * 6  # 6 shapes (4 tuned) x M 1..16
    for _, e, h, i, k, m, fmt, want in moe:
        got = moe_launch_config.lookup(e, h, i, k, m, fmt, device)
        assert dataclasses.asdict(got) == CONFIGS[want], (name, e, h, i, k, m, fmt)
    for _, element_size, want in rows("mla", name):
        assert dataclasses.asdict(mla_decode.launch_config(device, element_size)) == CONFIGS[want], (name, element_size)
    names = launch_tables.config_devices(device)
    for _, n, k, m, want, rule in rows("head", name):
        cfg, got_rule = gemv_config.lookup(n, k, m, names)
        assert (dataclasses.asdict(cfg), got_rule) == (CONFIGS[want], rule), (name, n, k, m)


def test_the_head_under_the_interpreter_as_before():
    ((_, n, k, m, want, rule),) = rows("head", "interpreter")
    cfg, got_rule = gemv_config.lookup(n, k, m, "cpu", interpreter=True)
    assert (dataclasses.asdict(cfg), got_rule) == (CONFIGS[want], rule)


@pytest.mark.parametrize("table", [moe_launch_config.TABLE, mla_decode.TABLE, gemv_config.TABLE],
                         ids=lambda t: t.what)
def test_a_committed_file_written_back_is_the_same_file(table, tmp_path):
    """What `save` writes is what is committed: a tuning run's diff shows its own entries only."""
    copy = dataclasses.replace(table, path=tmp_path / table.path.name)
    copy.path.write_text(table.path.read_text())
    entries = json.loads(table.path.read_text())
    for e in entries:  # each entry saved again on its own, with its note
        key = tuple(e["key"][f] for f in table.key_fields)
        copy.save({key: table.config_type(**e["config"])}, e.get("measured"))
    assert copy.path.read_text() == table.path.read_text()


# ------------------------------------------------------------------------------- the validator

@dataclass(frozen=True)
class Tile:
    block: int = 32
    stages: int = 2

    def __post_init__(self) -> None:
        check_power_of_two(self, ("block",), least=16, why="a test tile")


KEY = {"shape": 64, "device": "gpu-a"}


def table_at(path: Path) -> LaunchTable:
    return LaunchTable(path, Tile, ("shape", "device"), "test kernel")


def write(path: Path, entries) -> Path:
    path.write_text(entries if isinstance(entries, str) else json.dumps(entries))
    return path


@pytest.mark.parametrize("block", [48, 8, 0, -16])
def test_check_power_of_two_refuses_others_and_small_ones(block):
    with pytest.raises(ValueError, match=rf"Tile.block must be a power of two >= 16 \(a test tile\), got {block}$"):
        Tile(block=block)
    assert Tile(block=16).block == 16 and Tile(block=1024).block == 1024


def test_check_power_of_two_without_a_bound():
    @dataclass
    class Plain:
        n: int
    check_power_of_two(Plain(1), ("n",))
    with pytest.raises(ValueError, match=r"^Plain.n must be a power of two, got 6$"):
        check_power_of_two(Plain(6), ("n",))


def test_a_good_file_loads_with_defaults_for_fields_left_out(tmp_path):
    path = write(tmp_path / "t.json", [{"key": KEY, "config": {"block": 64}, "measured": "run a"}])
    assert table_at(path).load() == {(64, "gpu-a"): Tile(block=64, stages=2)}
    assert table_at(tmp_path / "none.json").load() == {}


@pytest.mark.parametrize("entries, why", [
    ([{"key": KEY, "config": {"block": 48}}], r"entry 0, key \{\"shape\": 64, \"device\": \"gpu-a\"\}: "
                                              r"Tile.block must be a power of two >= 16"),
    ([{"key": KEY, "config": {"blocks": 64}}], r"entry 0, key .*gpu-a.*unexpected keyword argument 'blocks'"),
    ([{"key": {**KEY, "format": "bf16"}, "config": {}}], r"entry 0, key .*bf16.*: key fields are \['shape', 'device'\]"),
    ([{"key": {"shape": 64}, "config": {}}], r"entry 0, key \{\"shape\": 64\}: key fields are"),
    ([{"key": {"shape": 64, "device": 7}, "config": {}}], r"key field 'device' is a name, got 7"),
    ([{"key": {"shape": 6.5, "device": "g"}, "config": {}}], r"key field 'shape' is a number or name, got 6.5"),
    ([{"key": KEY, "config": {}, "note": "x"}], r"entry 0, key .*: unknown entry fields \['note'\]"),
    ([{"key": KEY, "config": {}, "measured": 3}], r"measured is text, got 3"),
    ([{"key": KEY, "config": {}}, {"key": KEY, "config": {"block": 64}}], r"entry 1, key .*: a second entry"),
    ([{"config": {}}], r"entry 0, key null: an entry is"),
    (["x"], r"entry 0, key \?: an entry is"),
    ({"key": KEY}, r"a list of entries, got dict"),
    ("[{", r"not JSON"),
])
def test_a_malformed_file_is_refused_naming_the_file_and_the_key(tmp_path, entries, why):
    path = write(tmp_path / "bad.json", entries)
    with pytest.raises(ValueError, match=rf"bad.json: malformed tuned test kernel configs \(.*{why}"):
        table_at(path).load()
    before = path.read_text()
    with pytest.raises(ValueError, match="bad.json: malformed"):
        table_at(path).save({(32, "gpu-b"): Tile()})
    assert path.read_text() == before  # nothing written over a file that does not read


def test_save_merges_by_key_sorted_and_refuses_bad_keys_or_configs(tmp_path):
    table = table_at(tmp_path / "t.json")
    table.save({(64, "gpu-b"): Tile(block=64)})
    table.save({(32, "gpu-a"): Tile(), (64, "gpu-b"): Tile(block=128)}, "run 2")
    assert [e["key"] for e in json.loads(table.path.read_text())] == [{"shape": 32, "device": "gpu-a"},
                                                                      {"shape": 64, "device": "gpu-b"}]
    assert table.load() == {(32, "gpu-a"): Tile(), (64, "gpu-b"): Tile(block=128)}
    with pytest.raises(ValueError, match=r"a test kernel key is \(shape, device\), got \(64,\)"):
        table.save({(64,): Tile()})
    with pytest.raises(TypeError, match="a test kernel config is a Tile"):
        table.save({(64, "gpu-c"): {"block": 64}})
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]  # no temporary file left


def test_a_table_is_keyed_by_device_last():
    with pytest.raises(ValueError, match="last key field is 'device'"):
        LaunchTable(Path("t.json"), Tile, ("device", "shape"), "test kernel")


def test_first_entry_tries_every_shape_under_a_device_before_the_next_device():
    table = {(1, "sibling"): "s-exact", (0, "own"): "own-any"}
    assert launch_tables.first_entry(table, [(1,), (0,)], ("own", "sibling")) == ("own-any", 1, 0)
    assert launch_tables.first_entry(table, [(1,)], ("own", "sibling")) == ("s-exact", 0, 1)
    assert launch_tables.first_entry(table, [(2,)], ("own", "sibling")) is None
