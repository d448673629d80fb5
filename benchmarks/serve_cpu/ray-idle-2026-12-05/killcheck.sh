#!/bin/bash
# a tandem server's replica killed with SIGKILL: does its vLLM engine end? then the server stopped: any orphan?
cd /work/main
export HF_HUB_OFFLINE=1 VLLM_HOST_IP=127.0.0.1 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 TOKENIZERS_PARALLELISM=false
setsid .venv/bin/tandem serve --config ray_config.yaml --engine vllm --proposer none --http-port 8400 --grpc-port 9400 > /tmp/killcheck-serve.log 2>&1 &
SERVER=$!
for i in $(seq 300); do grep -q "tandem is serving" /tmp/killcheck-serve.log && break; sleep 2; done
echo "ready after $((i*2)) s"
show() { ps -eo pid,ppid,stat,etimes,cmd | grep -E "VLLM::EngineCore|cluster.vllm.reaper|ServeReplica" | grep -v grep | cut -c1-150; }
show
REPLICA=$(pgrep -f "ray::ServeReplica:tandem" | head -1)
ENGINE=$(ps -eo pid,ppid,cmd | awk -v r=$REPLICA '$2==r && $3 ~ /VLLM::EngineCore/ {print $1}')
echo "replica $REPLICA engine $ENGINE: SIGKILL the replica at $(date +%T.%N)"
kill -9 $REPLICA
for i in $(seq 100); do [ -z "$(ps -o stat= -p $ENGINE | grep -v Z)" ] && break; sleep 0.1; done
echo "engine $ENGINE state after $((i))00 ms: '$(ps -o stat= -p $ENGINE)'"
sleep 5; show
for i in $(seq 200); do curl -s -m 60 http://127.0.0.1:8400/v1/completions -H 'Content-Type: application/json' -d '{"model":"SmolLM2-135M-Instruct","prompt":"def fib(n):","max_tokens":8,"temperature":0}' | grep -q '"text"' && break; sleep 3; done
echo "serving again after the kill: try $i"
show
kill -TERM $SERVER; wait $SERVER; echo "server stopped, rc $?"
sleep 8
echo "left over:"; show
