#!/bin/bash
# idle CPU of every process of a tandem server, per environment variant: /tmp/idle_variants.sh OUTDIR "VAR=V VAR2=V" ...
cd /work/main
export HF_HUB_OFFLINE=1 VLLM_HOST_IP=127.0.0.1 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 TOKENIZERS_PARALLELISM=false
out=$1; shift; mkdir -p $out; n=0
for variant in "$@"; do
  n=$((n+1))
  env $variant setsid .venv/bin/tandem serve --config /tmp/nocompile.yaml --engine vllm --proposer none --http-port 8400 --grpc-port 9400 > $out/$n.log 2>&1 &
  S=$!
  for i in $(seq 300); do grep -q "tandem is serving" $out/$n.log && break; sleep 2; done
  sleep 15
  .venv/bin/python -c "
import sys; sys.argv=['x']
from tools.serve_cpu import idle, format_idle
print('variant: $variant'); print(format_idle(idle(30), 40))" > $out/$n.txt 2>&1
  ps -eo pid,cmd | grep -E "ray::|raylet|gcs_server|dashboard|log_monitor|runtime_env" | grep -v grep | cut -c1-120 >> $out/$n.txt
  kill -TERM $S; wait $S
  sleep 5
done
