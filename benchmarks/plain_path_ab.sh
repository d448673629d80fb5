#!/usr/bin/env bash
# The plain path's A/B of BENCHMARKS.md ("Serve's throughput mode"): each server alone, one after the other;
# CPU per token per process from tools.serve_cpu. Stop other CPU jobs first (the draft-data job).
#   benchmarks/plain_path_ab.sh OUT_DIR RUN...     RUN: vllm | tandem | tandem:VAR=VALUE[,VAR=VALUE...]
# e.g. benchmarks/plain_path_ab.sh /tmp/ab vllm tandem tandem:RAY_SERVE_THROUGHPUT_OPTIMIZED=0
set -uo pipefail
cd "$(dirname "$0")/.."
out=$1; shift; mkdir -p "$out"
export HF_HUB_OFFLINE=1 VLLM_HOST_IP=127.0.0.1 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 VLLM_CPU_OMP_THREADS_BIND=0-1 \
       VLLM_CPU_KVCACHE_SPACE=2
model=$(.venv/bin/python -c "from cluster.model import models; print(models.resolve_model_path('default'))")
probe='{"model":"SmolLM2-135M-Instruct","prompt":"hi","max_tokens":2}'
n=0
for run in "$@"; do
  n=$((n + 1)); tag="$n-${run//[^A-Za-z0-9_=.-]/_}"; kind=${run%%:*}; extra=()
  [[ $run == *:* ]] && IFS=, read -ra extra <<< "${run#*:}"
  if [ "$kind" = vllm ]; then port=8400
    env "${extra[@]}" setsid .venv/bin/python -m vllm.entrypoints.openai.api_server --model "$model" \
      --served-model-name SmolLM2-135M-Instruct --host 127.0.0.1 --port $port --dtype bfloat16 --max-model-len 2048 \
      > "$out/$tag.log" 2>&1 &
  else port=8300
    env "${extra[@]}" setsid .venv/bin/python -m deployments.cli serve --config ray_config.yaml --engine vllm \
      --proposer none --http-port $port --grpc-port 8301 > "$out/$tag.log" 2>&1 &
  fi
  pid=$!
  for _ in $(seq 1 150); do  # ready when a completion is answered (/v1/models answers before the replica is up)
    curl -sf -m 60 "http://127.0.0.1:$port/v1/completions" -H 'content-type: application/json' -d "$probe" \
      > /dev/null && break
    kill -0 $pid 2> /dev/null || break; sleep 3
  done
  sleep 10
  .venv/bin/python -m tools.serve_cpu --url "http://127.0.0.1:$port" --idle 10 --requests 12 --max-tokens 128 \
    --streams 1 --top 10 > "$out/$tag.txt" 2>&1
  .venv/bin/python -m tools.serve_cpu --url "http://127.0.0.1:$port" --requests 48 --max-tokens 64 --streams 16 \
    --top 8 >> "$out/$tag.txt" 2>&1
  kill -TERM -- -$pid  # the whole group: Serve's controller may take its 30 s timeout
  for _ in $(seq 1 90); do kill -0 $pid 2> /dev/null || break; sleep 1; done
  kill -9 -- -$pid 2> /dev/null
  echo "$tag: $(grep -o '[0-9.]* ms a token (wall)' "$out/$tag.txt" | head -1), $(grep -o '[0-9.]* tok/s' "$out/$tag.txt" | sed -n 2p) at 16 streams"
done
