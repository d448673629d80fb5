import os, sys, time, json
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))); sys.path.insert(0, ROOT); os.chdir(ROOT)
from cluster.model import models
from tools.peer_bench import Process, openmp_env, server_argv, server_env
from tools.serve_cpu import measure
side = sys.argv[1]
env = {**server_env("0-1"), **openmp_env(side)}
p = Process(side, server_argv(side, str(models.resolve_model_path("default")), "ray_config.yaml", "bfloat16", 2048, 8300), "http://127.0.0.1:8300", env, f"/tmp/s16-{side}.log")
try:
    time.sleep(10)
    out = [round(measure(p.url, p.model, 96, 64, 16)["tokens_per_s"], 1) for _ in range(3)]
    print(json.dumps({"side": side, "stream16_tok_s": out}), flush=True)
finally:
    p.stop()
