#!/usr/bin/env bash
# Issue #25's GPU checks as one call of a lent GPU machine (about 9 minutes at most).
#
#   bash benchmarks/gpu_session.sh wheels        # here, once: .whl/ <- what the GPU image lacks
#   bash benchmarks/gpu_session.sh [STEP ...]    # there (device `run`, carry [".whl"], timeout_s 600)
#
# Steps, in order (default: all): tests, local, kernels, attention_gpu, attention_cpu, dispatch,
# kernel_tests; also sweep, prefill, mla_tests, fp8_tests, mla_fp8, transports, spin, cluster and
# medium when named (#57's device half: `bash benchmarks/gpu_session.sh cluster medium`). Each has its own time limit, cut to
# what is left of BUDGET seconds (default 540), and writes its results under $OUT as it goes, so a
# step that overruns costs only itself and the
# steps after it still run while time is left. Files back ($OUT, at most 8): log.txt (everything,
# each step's rc and seconds), env.txt, local_engine.json, kernels.json, attention_gpu.json,
# attention_cpu.json, dispatch.json.
#
# The GPU machine (../.library/device/KINDS.md) has python3 with a CUDA torch, triton,
# transformers, numpy, safetensors, pytest, yaml, jinja2, tokenizers and no network; the wheels
# carried in .whl/ are the project's other imports on that path (cp312).
set -u
cd "$(dirname "$0")/.."
WHEELS="llguidance==1.9.1 grpcio==1.85.3 grpcio-health-checking==1.85.1 protobuf==7.36.2"

if [ "${1:-}" = wheels ]; then
    platforms=$(for n in 17 24 27 28 31 34 35; do printf -- "--platform manylinux_2_%s_x86_64 " $n; done)
    # shellcheck disable=SC2086
    exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp $platforms --platform manylinux2014_x86_64 -d .whl $WHEELS
fi

OUT=${OUT:-/tmp/gpu_session}
BUDGET=${BUDGET:-540}
mkdir -p "$OUT"
LOG=$OUT/log.txt
START=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
GPU="env MOE_CPU_KERNELS=0"  # the GPU steps skip building the C++ CPU kernels (~1 min); the CPU steps build them

step() {  # step NAME LIMIT_S COMMAND...: COMMAND under the smaller of LIMIT_S and the budget left
    local name=$1 limit=$2 left t0 rc
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

if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl >>"$LOG" 2>&1 && export PYTHONPATH=/tmp/site:$PWD
fi
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
    nproc
    python3 -c "import sys, torch, triton, transformers, grpc, google.protobuf as pb
print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__,
      'transformers', transformers.__version__, 'grpcio', grpc.__version__, 'protobuf', pb.__version__)
print(torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
    python3 -c "import flash_mla" 2>&1 | tail -1
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
    cluster) # #57: the cluster on one GPU (1 attention engine + 2 expert worker processes sharing it)
        # against LocalEngine on that GPU, CUDA IPC beside shared memory (rows through the host),
        # small preset, decode at batch 1 / 32 / 128, greedy tokens compared; the transport's own
        # tests first (two processes, rows on the device, a killed worker)
        step cuda_ipc_tests 90 $GPU python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda_ipc.py
        step cluster 200 $GPU python3 -m benchmarks.bench_attention --device cuda --dtype bfloat16 --tp 1 \
            --no-ray --batches 1,32,128 --rounds 2 --transports cuda-ipc,shm --out "$OUT/cluster_gpu.json" ;;
    medium) # #57: the medium preset (DeepSeek-V2-Lite's shape, ~16B bf16) drawn on the GPU, then the
        # same cluster rows against LocalEngine
        step medium_init 150 $GPU python3 -c "import time; t = time.time()
from services.presets import init_model
init_model('/tmp/medium', 'medium', dtype='bfloat16', device='cuda', shards=8, tokenizer=True)
print('medium preset written in', round(time.time() - t, 1), 's')"
        step medium 300 $GPU python3 -m benchmarks.bench_attention --model /tmp/medium --device cuda \
            --dtype bfloat16 --tp 1 --no-ray --batches 1,32,128 --rounds 2 --transports cuda-ipc,shm \
            --out "$OUT/cluster_gpu_medium.json" ;;
    kernel_tests) # the kernels' own tests, compiled for this GPU
        step kernel_tests 150 $GPU python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py \
            tests/test_triton_moe.py tests/test_decode_graphs.py tests/test_flashmla.py ;;
    *) echo "unknown step $s" | tee -a "$LOG" ;;
    esac
done
echo "== done in $(($(date +%s) - START))s; results in $OUT" | tee -a "$LOG"
grep -h -A12 '"targets"\|"summary"' "$OUT"/*.json 2>/dev/null | tail -40
