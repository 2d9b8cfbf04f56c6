"""A quick ladder on the embedded model: `python -m impl.serve [--device cuda] [--ladder ...] [--n 20]`;
or one row of it as an OpenAI-compatible server: `python -m impl.serve --http PORT --row SPEC`
(impl.serve.http).

Serves a workload (impl.data.workloads; default `arith`: held-out problems, stopping at the END
after `#### N`) on every row of the ladder, interleaved, and prints each row's medians (TTFT,
TPOT, decode tokens/s, latency), its mean accept length, its exact-answer rate (where the
workload has answers) and whether its provenance matches its name. A bad option, model, row or
workload is a usage error (exit 2) naming the problem.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from impl.serve import engine
from impl.serve.built_row import build_rows
from impl.serve.defaults import DEFAULT_LADDER
from impl.serve.rows import parse_ladder
from impl.serve.engine import EngineRow
from impl.serve.ladder import Ladder


def _median(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def _at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value
    return parse


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m impl.serve", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                   help="model dtype (default bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--model", default="tiny-gsm")
    p.add_argument("--ladder", default=DEFAULT_LADDER["cuda"])
    p.add_argument("--workload", default="arith",
                   help="arith, gsm8k[:FOLDER|HUB_ID], synthetic:IN:OUT or jsonl:FILE (impl.data.workloads)")
    p.add_argument("--n", type=_at_least(1), default=20, help="requests")
    p.add_argument("--lookahead", type=int, choices=(0, 1), default=engine.LOOKAHEAD,
                   help="steps queued ahead of the host's stop check on CUDA")
    p.add_argument("--threads", type=_at_least(1), default=None, help="torch CPU threads")
    p.add_argument("--warmup", type=_at_least(0), default=1,
                   help="warm-up requests per row (the first ones), not recorded")
    p.add_argument("--http", type=_at_least(1), default=None, metavar="PORT",
                   help="serve one row over HTTP on 127.0.0.1:PORT instead (impl.serve.http)")
    p.add_argument("--row", default="baseline", help="the row --http serves (a preset or a spec)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine.LOOKAHEAD = args.lookahead
    from impl.data.text import tokenizer_for
    from impl.data.workloads import load_workload
    from impl.model.build import build_model
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    if args.http is not None:
        from impl.serve.rows import parse_row
        from impl.serve.http import serve_http
        try:
            model = build_model(args.model, args.device, dtype)
            tokenizer = tokenizer_for(args.model, model.config.vocab_size)
            row = parse_row(args.row, args.device)
            served_rows = build_rows(model, [row], tokenizer=tokenizer)
        except (ValueError, TypeError, RuntimeError) as e:
            p.error(str(e))
        from impl.model.config import EMBEDDED
        from pathlib import Path
        root = str(EMBEDDED.get(args.model, Path(args.model)))
        serve_http(EngineRow(served_rows[0]), args.http, args.model, root)
        return 0
    try:  # what the options name: every problem here is the user's to fix, said as a usage error
        model = build_model(args.model, args.device, dtype)
        tokenizer = tokenizer_for(args.model, model.config.vocab_size)
        rows = parse_ladder(args.ladder, args.device)
        served_rows = [EngineRow(built) for built in build_rows(model, rows, tokenizer=tokenizer)]
        k = max(r.config.k for r in rows)  # a verify step writes k positions past the last token
        workload = load_workload(args.workload, tokenizer, model.config.max_seq_len - k, n=args.n)
    except (ValueError, TypeError, RuntimeError) as e:  # CheckpointError, RowError, WorkloadError, ...
        p.error(str(e))
    requests = list(workload)
    # Provenance is printed per row below, not raised: the table says which row is not what it says.
    served = Ladder(served_rows, requests, progress=print, warmup=args.warmup, check=False).run()
    by_id = {r.request_id: r for r in requests}
    print(f"{'row':<12} {'ttft ms':>8} {'tpot ms':>8} {'tok/s':>8} {'latency ms':>10} {'accept':>6} "
          f"{'exact':>6}  provenance")
    for row in served_rows:
        mine = [r for r in served if r.row == row.name]
        counts = [r.acceptance for r in mine if r.acceptance is not None and r.acceptance.verify_steps]
        steps = sum(a.verify_steps for a in counts)
        entry = row.entry()
        exact = (statistics.mean(bool(workload.score(by_id[r.request_id], r.text)["correct"]) for r in mine)
                 if workload.has_answers else float("nan"))
        print(f"{row.name:<12} {1e3 * _median(r.ttft_s for r in mine):8.3f} "
              f"{1e3 * _median(r.tpot_s for r in mine):8.3f} {_median(r.decode_tokens_per_s for r in mine):8.1f} "
              f"{1e3 * _median(r.latency_s for r in mine):10.2f} "
              f"{(sum(a.accepted for a in counts) + steps) / steps if steps else float('nan'):6.2f} {exact:6.1%}  "
              f"{entry.provenance_error or 'ok'}  graphs={entry.provenance.get('graphs')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
