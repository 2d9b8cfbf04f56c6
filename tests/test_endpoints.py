"""Server rows' pieces on recorded and synthetic responses: the streamed request and its timings,
every fault a stream can have, Prometheus counters, each engine's acceptance fields (vLLM,
SGLang's old and new names), server descriptions, and the server definitions file. The responses
here follow each engine's documented formats; tests/test_endpoint_rows.py runs real servers."""

from __future__ import annotations

import json

import httpx
import pytest

from moe_harness.ladder.endpoints import engines
from moe_harness.ladder.endpoints.metrics import SpecCounters, vllm_spec_counters
from moe_harness.ladder.endpoints.servers import ServerFileError, ladder_rows, load_servers, parse_url_row
from moe_harness.ladder.endpoints.stream import stream_completion

URL = "http://server.test/v1/completions"


def _sse(*events) -> bytes:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events).encode()


def _chunk(text, finish=None):
    return {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": text,
                                                                      "finish_reason": finish}]}


USAGE = {"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}}


def _client(body: bytes, status: int = 200) -> httpx.Client:
    return httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(status, content=body)))


def test_a_stream_is_timed_from_its_first_text_to_its_last_and_counted_by_its_usage():
    body = (_sse(_chunk("Tara ")) + b": keep-alive\n\n"  # an SSE comment
            + _sse(_chunk(""), _chunk("has 12"), _chunk("", "length"), USAGE, "[DONE]"))
    got = stream_completion(_client(body), URL, {"prompt": "x", "max_tokens": 5})
    assert got.error is None and got.text == "Tara has 12" and got.completion_tokens == 5
    assert got.finish_reason == "length" and len(got.itl_s) == 1  # one gap: between the two chunks with text
    assert 0 < got.ttft_s <= got.latency_s


def test_a_chat_stream_takes_its_text_from_the_deltas_not_the_role_chunk():
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    text = {"choices": [{"index": 0, "delta": {"content": "12"}}]}
    got = stream_completion(_client(_sse(role, text, USAGE, "[DONE]")), URL, {"messages": []}, chat=True)
    assert got.text == "12" and got.itl_s == []


def test_the_request_asks_for_a_stream_with_usage():
    seen = {}

    def handler(request):
        seen.update(json.loads(request.content))
        return httpx.Response(200, content=_sse(_chunk("a"), USAGE, "[DONE]"))
    stream_completion(httpx.Client(transport=httpx.MockTransport(handler)), URL, {"prompt": "x"})
    assert seen["stream"] is True and seen["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("body, status, problem", [
    (b"model overloaded", 503, "HTTP 503 from http://server.test/v1/completions: model overloaded"),
    (_sse(_chunk("a"))[:-2] + b"\n\ndata: {not json\n\n", 200, "malformed SSE line after 1 chunk(s)"),
    (b"event: nonsense\n\n", 200, "malformed SSE line (no 'data:') after 0 chunk(s)"),
    (_sse(_chunk("a"), {"error": {"message": "engine dead", "code": 500}}, "[DONE]"), 200,
     "the server sent an error event after 1 chunk(s)"),
    (_sse(_chunk("a"), USAGE), 200, "without its end ([DONE])"),
    (_sse(_chunk("a"), "[DONE]"), 200, "reported no usage"),
])
def test_every_fault_of_a_stream_is_the_requests_error_never_an_exception(body, status, problem):
    got = stream_completion(_client(body, status), URL, {"prompt": "x"})
    assert got.error is not None and problem in got.error, got.error


@pytest.mark.parametrize("error, problem", [
    (httpx.ConnectError("Connection refused"), "cannot connect to"),
    (httpx.ReadTimeout("timed out"), "timed out after"),
    (httpx.RemoteProtocolError("peer closed connection"), "the stream was cut"),
])
def test_a_refused_connection_a_timeout_and_a_cut_stream_are_errors(error, problem):
    def handler(request):
        raise error
    got = stream_completion(httpx.Client(transport=httpx.MockTransport(handler)), URL, {"prompt": "x"})
    assert problem in got.error


def test_a_client_side_stop_cuts_the_text_where_the_answer_ends():
    body = _sse(_chunk("= 12 shells.\n#"), _chunk("### 12\n6"), _chunk("6\n"), USAGE, "[DONE]")
    stop_at = lambda text: (lambda m: None if m < 0 else text.find("\n", m) if text.find("\n", m) >= 0 else None)(
        text.find("#### "))
    got = stream_completion(_client(body), URL, {"prompt": "x"}, stop_at=stop_at)
    assert got.error is None and got.stopped_by_client and got.text == "= 12 shells.\n#### 12"
    assert got.received.startswith(got.text + "\n") and got.completion_tokens is None


VLLM_METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 2.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.78e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 36.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 20.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 4.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


def test_vllm_counters_are_summed_over_engines_and_differenced_around_a_request():
    after = vllm_spec_counters(VLLM_METRICS)
    assert after == SpecCounters(12.0, 36.0, 20.0, (9.0, 7.0, 4.0))  # the _created gauges are not counts
    before = SpecCounters(2.0, 6.0, 4.0, (2.0, 1.0, 1.0))
    a = engines.acceptance_from_counters(after - before)
    assert (a.verify_steps, a.accepted, a.per_position, a.accept_length) == (10, 16, (7, 6, 3), 2.6)
    assert engines.acceptance_from_counters(before - before) is None  # nothing drafted: not speculating
    assert vllm_spec_counters("# TYPE x counter\nx_total 1\n") is None  # no speculation series at all
    with pytest.raises(ValueError, match="not a Prometheus text exposition"):
        vllm_spec_counters("vllm:spec_decode_num_drafts_total{engine= 1\n")


def test_vllms_per_request_block_gives_positions_from_its_histogram():
    block = {"metrics": {"speculative_decoding": {"num_spec_steps": 53, "num_accepted_draft_tokens": 74,
                                                  "acceptance_histogram": [10, 12, 31], "num_spec_tokens": 2}}}
    a = engines.acceptance_from_block(block, 128)
    # Position 0 accepted in every step that accepted 1 or 2 drafts (43), position 1 in those of 2 (31).
    assert (a.verify_steps, a.accepted, a.per_position) == (53, 74, (43, 31))
    assert a.accept_length == pytest.approx(1 + 74 / 53)


@pytest.mark.parametrize("block, accepted", [
    ({"meta_info": {"spec_verify_ct": 188, "spec_num_correct_drafts": 11, "spec_accepted_drafts": 11}}, 11),
    ({"meta_info": {"spec_verify_ct": 188, "spec_accepted_drafts": 11}}, 11),
    ({"meta_info": {"spec_verify_ct": 188, "spec_accept_token_num": 11, "spec_draft_token_num": 940}}, 11),
    # Only the verify count: the prefill's token and one token a step off the completion tokens.
    ({"meta_info": {"spec_verify_ct": 188, "spec_accept_length": 200 / 188}}, 11),
    ({"sglext": {"spec_tokens_details": {"spec_verify_ct": 188, "spec_num_correct_drafts": 11}}}, 11),
])
def test_sglang_acceptance_by_any_of_its_versions_names_in_one_definition(block, accepted):
    a = engines.acceptance_from_block(block, 200)
    assert (a.verify_steps, a.accepted, a.per_position) == (188, accepted, None)
    # One definition: tokens committed per verify step, without the prefill's token that SGLang's
    # own spec_accept_length (200 / 188 = 1.064) counts.
    assert a.accept_length == pytest.approx(1 + 11 / 188)


def test_no_acceptance_block_is_not_reported_never_zero():
    assert engines.acceptance_from_block({}, 10) is None
    assert engines.acceptance_from_block({"meta_info": {"id": "x"}}, 10) is None


SGLANG_INFO = {"model_path": "/models/glm", "served_model_name": "glm", "speculative_algorithm": "EAGLE",
               "speculative_num_steps": 3, "speculative_num_draft_tokens": 4, "moe_runner_backend": "humming",
               "quantization": "fp8", "version": "0.5.15", "tp_size": 1}


def test_servers_describe_themselves_by_engine():
    models = {"object": "list", "data": [{"id": "glm", "owned_by": "sglang", "root": "glm"}]}
    assert engines.detect_engine(models, None, SGLANG_INFO) == "sglang"
    info = engines.server_info("sglang", models, None, SGLANG_INFO)
    assert (info.engine, info.version, info.model) == ("sglang", "0.5.15", "glm")
    assert info.speculative == {"method": "EAGLE", "k": 3} and info.args["moe_runner_backend"] == "humming"
    vllm = {"data": [{"id": "tiny", "owned_by": "vllm", "root": "/ckpt"}]}
    config = {"vllm_config": {"speculative_config": {"method": "mtp", "num_speculative_tokens": 3},
                              "model_config": {"dtype": "torch.float32", "max_model_len": 384}}}
    info = engines.server_info("vllm", vllm, {"version": "0.32.0"}, config)
    assert (info.engine, info.version, info.speculative) == ("vllm", "0.32.0", {"method": "mtp", "k": 3})
    assert info.args == {"speculative": {"method": "mtp", "k": 3}, "dtype": "torch.float32", "max_model_len": 384}
    assert engines.server_info("vllm", vllm, {"version": "0.32.0"}, None).speculative is None  # not in dev mode
    with pytest.raises(ValueError, match="names no model"):
        engines.server_info("openai", {"data": []}, None, None)


# --- the definitions file -------------------------------------------------------------------------

GOOD = '''
[vars]
vllm = "{rootdir}/.venv-vllm/bin/python"

[[server]]
name = "plain"
command = ["{vllm}", "-m", "vllm.entrypoints.openai.api_server", "--model", "{model}", "--port", "{port}"]
env = { VLLM_CPU_KVCACHE_SPACE = "1" }

[[server]]
name = "mtp"
command = ["{vllm}", "--speculative-config", '{"method":"mtp","num_speculative_tokens":3}', "--port", "{port}"]
speculative = 3

[[server]]
name = "mine"
url = "http://127.0.0.1:8000/"
api_key_env = "MY_KEY"
chat = true
'''


def test_a_definitions_file_gives_its_rows_in_order_with_placeholders_filled(tmp_path):
    path = tmp_path / "servers.toml"
    path.write_text(GOOD)
    plain, mtp, mine = load_servers(path)
    assert [plain.managed, mtp.managed, mine.managed] == [True, True, False] and mine.url == "http://127.0.0.1:8000"
    command, env = plain.resolve({"port": "9000", "model": "/ckpt", "rootdir": "/repo", "python": "py",
                                  "host": "127.0.0.1", "here": "/repo"})
    assert command == ["/repo/.venv-vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/ckpt",
                       "--port", "9000"] and env == {"VLLM_CPU_KVCACHE_SPACE": "1"}
    command, _ = mtp.resolve({"port": "1", "model": "m", "rootdir": "/r", "python": "p", "host": "h", "here": "/r"})
    assert '{"method":"mtp","num_speculative_tokens":3}' in command  # JSON braces are not placeholders
    assert mtp.speculative == 3 and "api_key_env" not in mine.definition()


@pytest.mark.parametrize("text, problem", [
    ("[[server]]\nname = 'a'\n", "give either url"),
    ("[[server]]\nname = 'a'\nurl = 'http://h:1'\ncommand = ['x']\n", "give either url"),
    ("[[server]]\nname = 'a'\nurl = 'h:1'\n", "is not an http(s)://HOST:PORT address"),
    ("[[server]]\nname = 'a'\nurl = 'http://h:1'\nspeed = 1\n", "unknown key(s) ['speed']"),
    ("[[server]]\nname = 'a'\nurl = 'http://h:1'\nspeculative = true\n", "speculative = True is not a int"),
    ("[[server]]\nname = 'a'\nurl = 'http://h:1'\nengine = 'tgi'\n", "engine 'tgi' is not one of"),
    ("[[server]]\nname = 'a'\nurl = 'http://h:1'\n[[server]]\nname = 'a'\nurl = 'http://h:2'\n",
     "appear more than once"),
    ("[[server]]\nname = 'a b'\nurl = 'http://h:1'\n", "needs a name"),
    ("[servers]\n", "unknown table(s) ['servers']"),
    ("[[server]\n", "not valid TOML"),
])
def test_a_bad_definitions_file_is_refused_naming_the_file_and_row(tmp_path, text, problem):
    path = tmp_path / "servers.toml"
    path.write_text(text)
    with pytest.raises(ServerFileError, match=None) as e:
        load_servers(path)
    assert problem in str(e.value) and str(path) in str(e.value)


def test_an_unknown_placeholder_is_named(tmp_path):
    path = tmp_path / "servers.toml"
    path.write_text("[[server]]\nname = 'a'\ncommand = ['{nope}']\n")
    (row,) = load_servers(path)
    with pytest.raises(ServerFileError, match=r"\('a'\): command: unknown placeholder \{nope\}"):
        row.resolve({"port": "1"})


def test_a_url_row_is_checked():
    assert parse_url_row("vllm", "http://127.0.0.1:8000/").url == "http://127.0.0.1:8000"
    with pytest.raises(ServerFileError, match="row 'x'"):
        parse_url_row("x", "127.0.0.1:8000")


def test_a_definitions_files_ladder_table_sets_blocks_and_one_server_at_a_time(tmp_path):
    path = tmp_path / "servers.toml"
    path.write_text("[ladder]\nblock = 10\none_at_a_time = true\n[[server]]\nname = 'a'\nurl = 'http://h:1'\n")
    loaded = load_servers(path)
    assert (loaded.block, loaded.one_at_a_time, [r.name for r in loaded]) == (10, True, ["a"])
    path.write_text("[ladder]\none_at_a_time = true\n[[server]]\nname = 'a'\nurl = 'http://h:1'\n")
    with pytest.raises(ServerFileError, match="one_at_a_time needs a block"):
        load_servers(path)
    path.write_text("[ladder]\nblock = 0\n[[server]]\nname = 'a'\nurl = 'http://h:1'\n")
    with pytest.raises(ServerFileError, match="block must be a number of requests >= 1"):
        load_servers(path)


def test_a_definitions_files_ladder_rows_are_the_ladder_unless_the_option_names_one(tmp_path):
    path = tmp_path / "servers.toml"
    servers = "[[server]]\nname = 'a'\nurl = 'http://h:1'\n[[server]]\nname = 'b'\nurl = 'http://h:2'\n"
    path.write_text("[ladder]\nrows = 'b;a;+mtp'\n" + servers)
    loaded = load_servers(path)
    assert [r.name for r in ladder_rows(None, loaded, "cpu")] == ["b", "a", "+mtp"]
    assert [r.name for r in ladder_rows("a;b", loaded, "cpu")] == ["a", "b"]  # the option wins
    path.write_text(servers)
    assert [r.name for r in ladder_rows(None, load_servers(path), "cpu")] == ["a", "b"]  # every server, in order
    path.write_text("[ladder]\nrows = ['a', 'b']\n" + servers)
    with pytest.raises(ServerFileError, match=r"rows must be a ladder as --moe-ladder takes it"):
        load_servers(path)
