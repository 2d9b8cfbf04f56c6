"""impl.serve.ladder: interleaving order, warm-up, what a run stopped part-way keeps and where it
stopped, progress lines, provenance refused before the run, memory flat over many requests."""

from __future__ import annotations

import gc
import re

import pytest

from impl.data.arith import take
from impl.serve.built_row import build_rows
from impl.serve.rows import parse_ladder
from impl.serve.engine import EngineRow
from impl.serve.provenance import ProvenanceError, unshared_head_row
from impl.serve.result import LadderStopped
from impl.serve.ladder import Ladder, interleaved_order
from tests.helpers import byte_tokenizer, request


@pytest.fixture(scope="module")
def built_rows(model):
    """The ladder's rows: each row served by its own EngineRow, kept for the module."""
    return [EngineRow(a) for a in build_rows(model, parse_ladder("baseline;+fp8-head;+mtp", "cpu"),
                                             tokenizer=byte_tokenizer())]


def requests(n, max_tokens=3):
    problems = take("heldout", n, seed=4)
    return [request(p.prompt, max_tokens, rid=f"q{i}", ignore_eos=True) for i, p in enumerate(problems)]


def test_interleaved_order_alternates():
    assert [interleaved_order("ABC", i) for i in range(3)] == [list("ABC"), list("CBA"), list("ABC")]


def test_every_row_serves_every_request_alternating(built_rows):
    lines = []
    before = [a.provenance.requests if a.provenance else 0 for a in built_rows]
    served = Ladder(built_rows, requests(4), progress=lines.append, progress_interval_s=0, warmup=2).run()
    names = [a.name for a in built_rows]
    assert [(r.request_id, r.row) for r in served] == [
        (f"q{i}", a) for i in range(4) for a in (names if i % 2 == 0 else names[::-1])]
    # Two warm-up requests per row, not recorded, before the first record.
    assert [a.provenance.requests - b for a, b in zip(built_rows, before)] == [4 + 2] * 3
    with pytest.raises(ValueError, match="warmup must be a number of requests >= 0"):
        Ladder(built_rows, requests(1), warmup=-1)
    assert len(lines) == len(served)
    assert re.fullmatch(r"12/12 records, [\d.]+/s, elapsed \d+m\d\ds, ETA 0m00s; last baseline request 'q3'",
                        lines[-1]), lines[-1]
    assert lines[0].startswith("1/12 records")


def test_a_run_stopped_part_way_keeps_what_completed_and_says_where(built_rows):
    reqs = requests(3)

    def interrupt_after_four(served):
        if len(ladder.served) == 4:
            raise KeyboardInterrupt

    lines = []
    ladder = Ladder(built_rows, reqs, progress=lines.append)
    with pytest.raises(KeyboardInterrupt):
        ladder.run(on_request=interrupt_after_four)
    assert [r.request_id for r in ladder.served] == ["q0"] * 3 + ["q1"]
    assert lines[-1] == "stopped after 4 record(s): KeyboardInterrupt: "
    # An error in a later request: here one that does not fit the model's context.
    bad = [*reqs[:2], request(reqs[2].prompt, 10_000, rid="too-long")]
    with pytest.raises(LadderStopped) as e:
        Ladder(built_rows, bad, warmup=0).run()
    stop = e.value
    assert (stop.failure.row, stop.failure.request, stop.failure.kind) == (built_rows[0].name, "too-long", "failed")
    assert stop.failure.error.startswith("ValueError: request 'too-long'") and isinstance(stop.__cause__, ValueError)
    assert [r.request_id for r in stop.served] == ["q0"] * 3 + ["q1"] * 3
    # Iterating gives the same requests one at a time.
    assert next(iter(Ladder(built_rows, reqs[:1], warmup=0))).row == built_rows[0].name


def test_a_defective_row_is_refused_after_its_warm_up(model, built_rows):
    bad = EngineRow(unshared_head_row(built_rows[2].built, "copy"))
    ladder = Ladder([built_rows[0], bad], requests(2))
    with pytest.raises(ProvenanceError, match=r"(?s)row '\+mtp'.*the draft's head is a different module"):
        ladder.run()
    assert ladder.served == []


def test_a_row_whose_backend_refuses_the_request_is_named(model, monkeypatch):
    """A backend's impl.backends.Unsupported (input it does not cover) stops the ladder as a refusal
    of the row that names it, not as a traceback from the backend."""
    from impl import backends
    from impl.moe.gather import moe_gather  # noqa: F401  (the built-ins registered)

    def refuse(*args, **kwargs):
        raise backends.Unsupported("tokens past my tiles")
    monkeypatch.setattr(backends, "_registry", dict(backends._registry))
    backends.register(backends.Backend("moe", "refusing", refuse, "refuses everything"))
    rows = [EngineRow(a) for a in build_rows(model, parse_ladder("baseline;no=moe=refusing", "cpu"),
                                             tokenizer=byte_tokenizer())]
    with pytest.raises(LadderStopped, match=r"row 'no' refused while preparing its steps: a backend it names does "
                                            r"not cover the model's steps: Unsupported: tokens past my tiles") as e:
        Ladder(rows, requests(2)).run()
    assert e.value.failure.kind == "refused"


def _rss_bytes() -> int:
    import os
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_memory_is_flat_over_many_requests(built_rows):
    # Two rows (plain and MTP), 2 x 150 short requests: neither the number of live Python
    # objects nor the process's resident set may grow with the number of requests once warm
    # (tracemalloc would be the finer tool, but it slows these torch-heavy loops tenfold). The
    # ladder keeps what it served: 300 small records, under the object bound below.
    pair = [built_rows[0], built_rows[2]]
    problems = take("heldout", 150, seed=6)
    reqs = [request(p.prompt[-16:], 2, rid=f"m{i}", ignore_eos=True) for i, p in enumerate(problems)]
    for _ in Ladder(pair, reqs[:20]):
        pass
    marks = []
    for i, _ in enumerate(Ladder(pair, reqs, warmup=0)):
        if i % 100 == 0:
            gc.collect()
            marks.append((len(gc.get_objects()), _rss_bytes()))
    gc.collect()
    marks.append((len(gc.get_objects()), _rss_bytes()))
    objects = [m[0] for m in marks]
    # 200 records between the second mark and the last: a leak of one object per request shows.
    assert objects[-1] - objects[1] < 100, f"live Python objects at every 100 records: {objects}"
    rss = [m[1] / 2**20 for m in marks]
    assert rss[-1] - rss[1] < 8, f"resident set (MiB) at every 100 records: {[round(r, 1) for r in rss]}"
    assert len(pair[1].provenance.moe) <= 2  # provenance keeps sets of what ran, not events


def test_an_optional_row_out_of_memory_in_its_warm_up_is_dropped(built_rows, monkeypatch):
    import dataclasses

    import torch

    from impl import backends
    order, released = [], []
    real = EngineRow.prepare

    def prepare(row):
        order.append(row.name)
        if row.name == "+fp8-head":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 120.00 MiB")
        real(row)

    monkeypatch.setattr(EngineRow, "prepare", prepare)
    key = ("moe", built_rows[1].built.config.moe)
    monkeypatch.setitem(backends._registry, key, dataclasses.replace(backends._registry[key],
                                                                       release=lambda: released.append(key)))
    lines = []
    ladder = Ladder(built_rows, requests(2), progress=lines.append, warmup=1, optional=["+fp8-head"])
    served = ladder.run()
    assert order == ["baseline", "+mtp", "+fp8-head"]  # the optional row is warmed up last
    assert [(r.request_id, r.row) for r in served] == [("q0", "baseline"), ("q0", "+mtp"),
                                                       ("q1", "+mtp"), ("q1", "baseline")]
    assert ladder.dropped["+fp8-head"].startswith("out of device memory in its warm-up (CUDA out of memory.")
    assert released == [key] and built_rows[1].provenance is None
    assert any("row '+fp8-head' dropped" in line for line in lines)
    # A row not named optional ends the run, as any error does; so does an unknown optional name.
    order.clear()
    with pytest.raises(LadderStopped) as e:
        Ladder(built_rows, requests(1), warmup=1).run()
    assert isinstance(e.value.__cause__, torch.cuda.OutOfMemoryError) and e.value.failure.row == "+fp8-head"
    with pytest.raises(ValueError, match=r"optional rows \['nope'\] are not among the rows"):
        Ladder(built_rows, requests(1), optional=["nope"])


# ------------------------------------------------------------------ the command line (python -m impl.serve)

@pytest.mark.parametrize("args, problem", [
    (["--n", "0"], "argument --n: expected an integer >= 1, got 0"),
    (["--dtype", "float64x"], "argument --dtype: invalid choice: 'float64x'"),
    (["--threads", "-2"], "argument --threads: expected an integer >= 1, got -2"),
    (["--model", "nosuch"], "'nosuch' is neither a preset"),
    (["--ladder", "baseline;x=moe=nosuch"], "moe: unknown MoE backend 'nosuch'"),
    (["--workload", "synthetic:0:4"], "synthetic"),
])
def test_the_command_line_answers_a_bad_option_with_a_usage_error(capsys, args, problem):
    from impl.serve.__main__ import main
    with pytest.raises(SystemExit) as info:
        main(["--device", "cpu", "--n", "3", *args])
    assert info.value.code == 2
    assert problem in capsys.readouterr().err


def test_the_command_line_prints_provenance_problems_in_its_table_instead_of_stopping(capsys, monkeypatch):
    """A row that is not what it says is a line of the table, as the module says, not a traceback."""
    from impl.serve import __main__ as cli
    from impl.serve import engine
    monkeypatch.setattr(engine, "provenance_problems", lambda name, config, prov: [f"{name}: planted problem"])
    assert cli.main(["--device", "cpu", "--n", "3", "--ladder", "baseline;+fp8-head", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert "baseline: planted problem" in out and "+fp8-head: planted problem" in out


class _Row:
    """A row that serves instantly and records what was done to it, for the runner's schedules."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def prepare(self):
        pass

    def check(self):
        pass

    def serve(self, request):
        from impl.serve.result import ServedRequest
        self.log.append(f"{self.name}:{request.request_id}")
        return ServedRequest(self.name, request.request_id, 1, 2, 0.1, 0.2)

    def suspend(self):
        self.log.append(f"{self.name} down")

    def resume(self):
        self.log.append(f"{self.name} up")


def test_rows_that_cannot_be_up_together_serve_blocks_in_turn_each_brought_up_for_its_own():
    log = []
    rows = [_Row("a", log), _Row("b", log)]
    ladder = Ladder(rows, [request("1+1=", 2, rid=f"q{i}") for i in range(4)], warmup=1, block=2, one_at_a_time=True)
    ladder.run()
    assert log == ["a up", "a:q0", "a down", "b up", "b:q0", "b down",  # warm-up, one server at a time
                   "a up", "a:q0", "a:q1", "a down", "b up", "b:q0", "b:q1", "b down",  # block 1: A B
                   "b up", "b:q2", "b:q3", "b down", "a up", "a:q2", "a:q3", "a down"]  # block 2: B A
    assert "blocks of 2 requests" in ladder.schedule and "one row up at a time" in ladder.schedule
    with pytest.raises(ValueError, match="one row at a time needs blocks"):
        Ladder(rows, [], one_at_a_time=True)
