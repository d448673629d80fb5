"""One `tandem` server; streamed chat at 16 streams, alternating the default and num_speculative_tokens 0."""
import json, os, sys, time
from concurrent.futures import ThreadPoolExecutor
import httpx
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))); sys.path.insert(0, ROOT); os.chdir(ROOT)
from cluster.model import models
from cluster.core.workloads import PEER_CHAT_PROMPTS
from tools.peer_bench import Process, openmp_env, server_argv, server_env
side = sys.argv[1] if len(sys.argv) > 1 else "tandem"
env = {**server_env("0-1"), **openmp_env(side)}
p = Process(side, server_argv(side, str(models.resolve_model_path("default")), "ray_config.yaml", "bfloat16", 2048, 8300), "http://127.0.0.1:8300", env, f"/tmp/cap-{side}.log")
client = httpx.Client(timeout=600)
def stream(prompt, extra):
    body = {"model": p.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 64, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **extra}
    tokens, spec, events = 0, {}, 0
    with client.stream("POST", p.url + "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events += 1
                j = json.loads(line[6:])
                if j.get("usage"): tokens = j["usage"]["completion_tokens"]
                if j.get("speculation"): spec = j["speculation"]
    return tokens, spec.get("drafted", 0), spec.get("accepted", 0), events
try:
    time.sleep(10); stream(PEER_CHAT_PROMPTS[0], {})
    for rep in range(3):
        for name, extra in (("default", {}), ("plain", {"num_speculative_tokens": 0})):
            prompts = [PEER_CHAT_PROMPTS[i % len(PEER_CHAT_PROMPTS)] for i in range(96)]
            t = time.perf_counter()
            with ThreadPoolExecutor(16) as pool:
                res = list(pool.map(lambda q: stream(q, extra), prompts))
            wall = time.perf_counter() - t
            print(json.dumps({"run": name, "tok_s": round(sum(r[0] for r in res) / wall, 1), "drafted": sum(r[1] for r in res),
                              "accepted": sum(r[2] for r in res), "events": sum(r[3] for r in res)}), flush=True)
finally:
    p.stop()
