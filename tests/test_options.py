"""Every option's `parse_*` function, called directly: what each accepts, and the message naming the
option and the bad value it refuses with. The gate core's (pytest_moeperf.options) and the MoE
harness's (moe_harness.options). That a refused value stops a run as a usage error, named by its
ini key where it came from there, is shown once by whole runs (tests/test_plugin.py,
tests/test_plugin_misuse.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from impl.data.workloads import parse_workload
from moe_harness import options as moe
from pytest_moeperf import options as core

ROOT = Path("/repo")


@pytest.mark.parametrize("value, expected", [(None, None), ("", None), ("3", 3), ("100000", 100000)])
def test_parse_count_takes_a_whole_number_in_range_or_nothing(value, expected):
    assert core.parse_count("--n", value, 3, 100000) == expected


@pytest.mark.parametrize("value, bound", [("2", ">= 3"), ("x", ">= 3"), ("1.5", ">= 3")])
def test_parse_count_names_the_flag_the_bound_and_the_value(value, bound):
    with pytest.raises(ValueError, match=rf"--n must be a whole number {bound}, got '{value}'"):
        core.parse_count("--n", value, 3)
    with pytest.raises(ValueError, match=r"in \[3, 5\], got '6'"):
        core.parse_count("--n", "6", 3, 5)


@pytest.mark.parametrize("value, expected", [("auto", "auto"), ("CPU", "cpu"), (" cuda ", "cuda"),
                                             ("cuda:1", "cuda:1")])
def test_parse_device_normalizes_the_four_forms(value, expected):
    assert core.parse_device(value) == expected


@pytest.mark.parametrize("value", ["tpu", "cuda:", "cuda:x", "gpu:0"])
def test_parse_device_refuses_anything_else(value):
    with pytest.raises(ValueError, match="--moe-device must be auto, cpu, cuda or cuda:N"):
        core.parse_device(value)


def test_parse_samples_needs_three_for_a_median_and_an_interval():
    assert core.parse_samples("3") == 3
    with pytest.raises(ValueError, match="--moe-samples must be at least 3 .*got 2"):
        core.parse_samples("2")
    with pytest.raises(ValueError, match="--moe-samples must be a whole number >= 3, got 'abc'"):
        core.parse_samples("abc")


def test_parse_trust_is_zero_when_not_given_and_at_least_one_otherwise():
    assert core.parse_trust("") == 0 and core.parse_trust(None) == 0 and core.parse_trust("4") == 4
    with pytest.raises(ValueError, match="--moe-trust must be a whole number >= 1, got '0'"):
        core.parse_trust("0")


def test_parse_host_stall_takes_a_fraction_or_off():
    assert core.parse_host_stall("0.3") == 0.3 and core.parse_host_stall(" OFF ") is None
    for bad in ("0", "1", "nan", "high"):
        with pytest.raises(ValueError, match=f"--moe-host-stall must be a fraction .* got '{bad}'"):
            core.parse_host_stall(bad)


def test_parse_host_wait_takes_seconds_up_to_ten_minutes():
    assert core.parse_host_wait("0") == 0 and core.parse_host_wait("600") == 600
    for bad in ("-1", "601", "soon"):
        with pytest.raises(ValueError, match=rf"--moe-host-wait must be seconds in \[0, 600\], got '{bad}'"):
            core.parse_host_wait(bad)


def test_parse_report_path_is_taken_from_rootdir_and_never_the_markdown_beside_it():
    assert core.parse_report_path("", ROOT) is None
    assert core.parse_report_path("out/gate.json", ROOT) == ROOT / "out/gate.json"
    assert core.parse_report_path("/abs/gate.json", ROOT) == Path("/abs/gate.json")
    with pytest.raises(ValueError, match="--moe-report gate.md: is the JSON report's path.*written beside it as "
                                         "gate.md: give a path ending in .json"):
        core.parse_report_path("gate.md", ROOT)


def test_number_is_nan_for_text_so_every_range_check_refuses_it():
    assert core.number("2.5") == 2.5 and math.isnan(core.number("two"))


def test_a_gate_trust_option_needs_moe_bench_and_excludes_a_freeze():
    bench = core.Options(bench=True, device="cpu", baselines=ROOT, freeze=False, report=None, samples=5)
    core.check_trust_run("--moe-plant", "moe=0.1", bench)
    core.check_trust_run("--moe-plant", "", core.Options(bench=False, device="cpu", baselines=ROOT, freeze=False,
                                                         report=None, samples=5))
    with pytest.raises(ValueError, match="--moe-plant needs --moe-bench"):
        core.check_trust_run("--moe-plant", "moe=0.1", core.Options(bench=False, device="cpu", baselines=ROOT,
                                                                    freeze=False, report=None, samples=5))
    with pytest.raises(ValueError, match="--moe-trust and --moe-freeze exclude each other"):
        core.check_trust_run("--moe-trust", 3, core.Options(bench=True, device="cpu", baselines=ROOT, freeze=True,
                                                            report=None, samples=5))


def test_named_gives_the_ini_key_only_where_the_value_came_from_there():
    assert core.named("moe_workload", frozenset()) == "--moe-workload"
    assert core.named("moe_workload", frozenset({"moe_workload"})) == "ini key moe_workload (--moe-workload)"


# -- the MoE harness's ---------------------------------------------------------------------------

def test_parse_model_takes_a_preset_an_embedded_checkpoint_or_a_checkpoint_folder(tmp_path):
    assert moe.parse_model("tiny-gsm", tmp_path) == "tiny-gsm"
    assert moe.parse_model("tiny", tmp_path) == "tiny"
    with pytest.raises(ValueError, match=r"--moe-model 'nope' is neither a preset \(.*\), an embedded checkpoint "
                                         r"\(.*\) nor a folder \(looked for .*/nope"):
        moe.parse_model("nope", tmp_path)
    (tmp_path / "weights").mkdir()
    with pytest.raises(ValueError, match="--moe-model 'weights': .*weights has no config.json"):
        moe.parse_model("weights", tmp_path)


def test_parse_backend_takes_a_registered_backend_that_runs_on_the_device():
    assert moe.parse_backend("auto") == "auto"
    assert moe.parse_backend("gather", "cpu") == "gather"
    with pytest.raises(ValueError, match="--moe-backend: unknown moe backend 'nope'; available:"):
        moe.parse_backend("nope", "cpu")


def test_parse_backend_refuses_one_that_does_not_run_on_the_runs_device(monkeypatch):
    from impl import backends
    monkeypatch.setitem(backends._registry, ("moe", "gpu-only"),
                        backends.Backend("moe", "gpu-only", lambda *a: None, devices=("cuda",)))
    with pytest.raises(ValueError, match=r"the 'gpu-only' MoE backend runs on \['cuda'\], not on this run's device "
                                         r"\(cpu: --moe-device cpu\)"):
        moe.parse_backend("gpu-only", "cpu")


def test_parse_head_takes_bf16_or_fp8():
    assert moe.parse_head("fp8") == "fp8"
    with pytest.raises(ValueError, match="--moe-head must be one of bf16, fp8, got 'int4'"):
        moe.parse_head("int4")


def test_parse_requests_is_three_to_a_hundred_thousand():
    assert moe.parse_requests("") is None and moe.parse_requests("3") == 3
    with pytest.raises(ValueError, match=r"--moe-requests must be a whole number in \[3, 100000\], got '10000000'"):
        moe.parse_requests("10000000")


def test_parse_ladder_option_checks_every_row_and_needs_two():
    assert moe.parse_ladder_option(None, "cpu") is None
    assert moe.parse_ladder_option("baseline;+mtp", "cpu") == "baseline;+mtp"
    with pytest.raises(ValueError, match="--moe-ladder: .*nosuchpreset"):
        moe.parse_ladder_option("baseline;nosuchpreset", "cpu")
    with pytest.raises(ValueError, match="--moe-ladder 'baseline': one row; the ladder compares each row with its "
                                         "first"):
        moe.parse_ladder_option("baseline", "cpu")


def test_parse_servers_option_reads_the_file_from_rootdir_and_checks_its_api_keys(tmp_path, monkeypatch):
    assert moe.parse_servers_option("", tmp_path) == ()
    with pytest.raises(ValueError, match=r"--moe-servers none.toml: no such file \(.*none.toml; a relative path is "
                                         "taken from rootdir"):
        moe.parse_servers_option("none.toml", tmp_path)
    (tmp_path / "servers.toml").write_text('[[server]]\nname = "a"\nurl = "http://127.0.0.1:9"\n'
                                           'api_key_env = "MOEPERF_TEST_KEY"\n'
                                           '[[server]]\nname = "b"\nurl = "http://127.0.0.1:10"\n')
    monkeypatch.delenv("MOEPERF_TEST_KEY", raising=False)
    with pytest.raises(ValueError, match=r"the API key variable of row\(s\) 'a' \(MOEPERF_TEST_KEY\) is not set"):
        moe.parse_servers_option("servers.toml", tmp_path)
    monkeypatch.setenv("MOEPERF_TEST_KEY", "k")
    assert [s.name for s in moe.parse_servers_option("servers.toml", tmp_path)] == ["a", "b"]


def test_parse_server_errors_is_stop_or_continue():
    assert moe.parse_server_errors("continue") == "continue"
    with pytest.raises(ValueError, match="--moe-server-errors must be stop or continue, got 'retry'"):
        moe.parse_server_errors("retry")


def test_parse_workload_option_takes_a_relative_file_from_rootdir(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "1 + 1 ="}\n')
    spec = moe.parse_workload_option("jsonl:p.jsonl", tmp_path)
    assert spec.kind == "jsonl" and spec.source == str(tmp_path / "p.jsonl")
    with pytest.raises(ValueError, match=r"--moe-workload: .*missing.jsonl does not exist \('missing.jsonl' is "
                                         "relative: taken from rootdir"):
        moe.parse_workload_option("jsonl:missing.jsonl", tmp_path)
    assert moe.parse_workload_option("gsm8k:openai/gsm8k", tmp_path).source == "openai/gsm8k"  # a hub id stays one
    with pytest.raises(ValueError, match="--moe-workload: GSM8K folder .*no-such-folder does not exist"):
        moe.parse_workload_option("gsm8k:./no-such-folder", tmp_path)


def test_parse_margin_is_percentage_points_up_to_fifty():
    assert moe.parse_margin("1") == 0.01 and moe.parse_margin("50") == 0.5
    for bad in ("0", "-2", "51", "one"):
        with pytest.raises(ValueError, match=rf"--moe-margin must be in \(0, 50\] percentage points, got '{bad}'"):
            moe.parse_margin(bad)


def test_parse_expect_is_faster_or_not_slower():
    assert moe.parse_expect("") is None and moe.parse_expect("not-slower") == "not-slower"
    with pytest.raises(ValueError, match="--moe-expect must be one of faster, not-slower, got 'quicker'"):
        moe.parse_expect("quicker")


def test_parse_shots_only_for_gsm8k():
    assert moe.parse_shots("5", parse_workload("gsm8k")) == 5
    assert moe.parse_shots(None, parse_workload("arith")) is None
    with pytest.raises(ValueError, match="--moe-shots 5: only the gsm8k workload takes few-shot examples, and the "
                                         "workload is arith"):
        moe.parse_shots("5", parse_workload("arith"))
