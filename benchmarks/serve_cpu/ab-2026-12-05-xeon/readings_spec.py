"""Start `tandem` (argv[1] side), send chat requests at 1 and 16 streams, sum the speculation figures."""
import os, sys, time, json
from concurrent.futures import ThreadPoolExecutor
import httpx
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))); sys.path.insert(0, ROOT); os.chdir(ROOT)
from cluster.model import models
from cluster.core.workloads import PEER_CHAT_PROMPTS
from tools.peer_bench import Process, openmp_env, server_argv, server_env
side = sys.argv[1]; cfg = sys.argv[2] if len(sys.argv) > 2 else "ray_config.yaml"
env = {**server_env("0-1"), **openmp_env(side)}
p = Process(side, server_argv(side, str(models.resolve_model_path("default")), cfg, "bfloat16", 2048, 8300), "http://127.0.0.1:8300", env, f"/tmp/spec-{side}.log")
c = httpx.Client(timeout=600)
def one(prompt, n):
    r = c.post(p.url + "/v1/chat/completions", json={"model": p.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": n, "temperature": 0})
    j = r.json(); return j["usage"]["completion_tokens"], j.get("speculation") or {}
try:
    time.sleep(10); one(PEER_CHAT_PROMPTS[0], 8)
    for streams, reqs, n in ((1, 6, 128), (16, 48, 64)):
        prompts = [PEER_CHAT_PROMPTS[i % len(PEER_CHAT_PROMPTS)] for i in range(reqs)]
        t = time.perf_counter()
        with ThreadPoolExecutor(streams) as pool:
            res = list(pool.map(lambda q: one(q, n), prompts))
        wall = time.perf_counter() - t
        tok = sum(r[0] for r in res); d = sum(r[1].get("drafted", 0) for r in res); a = sum(r[1].get("accepted", 0) for r in res)
        rounds = sum(r[1].get("rounds", 0) for r in res)
        print(json.dumps({"side": side, "streams": streams, "tok_s": round(tok / wall, 1), "tokens": tok, "drafted": d, "accepted": a, "rounds": rounds}), flush=True)
finally:
    p.stop()
