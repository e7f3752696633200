#!/usr/bin/env bash
# The GPU checks and the benchmarks behind docs/benchmarks.md, in stages that
# each fit a 10-minute command on one H200:
#
#   bash scripts/h200_figures.sh tests        # GPU-only tests (kernels, policy, prefill)
#   bash scripts/h200_figures.sh breakdown    # per-step split, batch 64 x 4,096 tokens
#   bash scripts/h200_figures.sh diffkv       # serving throughput, DiffKV
#   bash scripts/h200_figures.sh full         # serving throughput, uncompressed bf16
#   bash scripts/h200_figures.sh compare      # the two over the window both served
#   bash scripts/h200_figures.sh attention    # the decode-attention grid
#   bash scripts/h200_figures.sh merged       # the launch that merges its own rows, against merge_rows
#   bash scripts/h200_figures.sh merged-step  # DiffKV's decode step with it (merge_impl=launch)
#   bash scripts/h200_figures.sh early        # the rows' loads before the first loop (early_row_loads)
#   bash scripts/h200_figures.sh early-step   # DiffKV's decode step with them
#   bash scripts/h200_figures.sh timeline     # when each program of a launch starts and ends
#   bash scripts/h200_figures.sh timeline-shapes  # the same at 32 x 16K and 128 x 4K
#   bash scripts/h200_figures.sh balance      # the caches' launch traced: what sharing work out could win
#   bash scripts/h200_figures.sh weights      # low pages weighed 15 / 8 of a high page (cuts on the tier boundary too), B = 32
#   bash scripts/h200_figures.sh weights-b128 # the same at B = 128
#   bash scripts/h200_figures.sh gap          # the item across a row's tier boundary holding fewer units, B = 32
#   bash scripts/h200_figures.sh chunks       # a row's rest taken in chunks from its cursor as the launch runs (row_chunk), B = 32
#   bash scripts/h200_figures.sh open         # the settings the H200 has not timed yet, in one call, B = 32
#   bash scripts/h200_figures.sh keys         # int8 key dots (one / two query digits), key dots a step ahead, B = 32
#   bash scripts/h200_figures.sh codes        # value codes in place, lanes' metadata once, K4V2 pages split, B = 32
#   bash scripts/h200_figures.sh codes-engine # the engine's GPU tests with values in place and the lanes' metadata once off
#   bash scripts/h200_figures.sh registers    # two warps per program; ptxas register caps (XLA_FLAGS) for 12 / 14 programs per multiprocessor
#   bash scripts/h200_figures.sh mosaic       # the decode on Mosaic GPU (16-bit, K8V4) against ours and JAX's
#   bash scripts/h200_figures.sh smollm2      # the embedded model's shapes, as the caches launch
#   bash scripts/h200_figures.sh ragged       # launches over an engine-like ragged batch
#   bash scripts/h200_figures.sh parts        # a launch's plan / kernel / merge, timed apart
#   bash scripts/h200_figures.sh policy       # the policy launch: its floor, the lane victim search
#   bash scripts/h200_figures.sh scoring      # window scoring (jnp, kernel) vs prefill attention
#   bash scripts/h200_figures.sh allocation   # a decode step's page allocation
#
# Results go to $OUT (default results/h200). Compiled executables are cached in
# $JAX_COMPILATION_CACHE_DIR (default /tmp/diffkv-jax-xla), so a stage run again
# on the same machine skips most compilation. The two throughput stages use the
# same seed, requests and memory budget (KV_BUDGET_GB, default 6), so their
# figures compare over the window both served (the compare stage).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/h200}
mkdir -p "$OUT"
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/diffkv-jax-xla}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-2}
# TIME_LIMIT: seconds of serving measured; WALL_LIMIT: the same, compilation included.
# The launches at Llama3-8B's 32 x 4K, chained, against JAX's kernel:
# tune_32x4k TUNE JSON [VARIANTS] (default: both tier mixes)
tune_32x4k() {
  python scripts/bench_attention.py --models llama3-8b --batches 32 --contexts 4096 \
    --variants "${3:-jax-bf16,diffkv-50/50,diffkv-mix}" --kernel-tiles tokens --chain 32 \
    --tune "$1" --json "$2"
}
THROUGHPUT="--model llama3-8b --kv-budget-gb ${KV_BUDGET_GB:-6} --num-requests 256 --output-len 4096
            --max-batch 128 --time-limit ${TIME_LIMIT:-300} --wall-limit ${WALL_LIMIT:-500}
            --profile-steps 5 --profile-at 120"

case "${1:-}" in
  tests)
    # (the GGUF test needs the gguf wheel, which the device lacks unless carried)
    python -m pytest -q -m gpu tests/ --ignore=tests/test_gguf_and_tokenizer.py ;;
  breakdown)
    python scripts/step_breakdown.py --model llama3-8b --methods full,diffkv --batch 64 \
      --context 4096 --iters 5 --profile 3 --top 20 --json "$OUT/step_breakdown.json" ;;
  diffkv|full)
    # METHOD_OPTS: options of the method, e.g. METHOD_OPTS="high_frac=0.5;low_frac=0.3"
    # shellcheck disable=SC2086
    python scripts/bench_throughput.py $THROUGHPUT --methods "$1${METHOD_OPTS:+:$METHOD_OPTS}" \
      --out "$OUT/throughput_$1" ;;
  compare)
    python scripts/compare_throughput.py "$OUT/throughput_full/throughput.json" \
      "$OUT/throughput_diffkv/throughput.json" ;;
  attention)
    python scripts/bench_attention.py --json "$OUT/bench_attention.json" ;;
  merged)
    # wave=1188 / 1584: 9 / 12 programs per multiprocessor, what the launch's registers
    # allow without / with the merge inside if XLA's compile matches the triton package's
    # (scripts/kernel_resources.py --merged 0,1); then the other shapes with the merge inside
    python -m pytest -q -m gpu tests/test_merged_decode.py
    V=jax-bf16,ours-bf16,diffkv-high,diffkv-50/50,diffkv-mix
    python scripts/bench_attention.py --models llama3-8b --batches 32 --contexts 4096 \
      --variants "$V" --kernel-tiles tokens --chain 32 \
      --tune "wave=1188;m=last;m=last,wave=1188;m=last,wave=1584" \
      --json "$OUT/bench_attention_merged_32x4k.json"
    python scripts/bench_attention.py --models llama3-8b --batches 32,128 --contexts 4096,16384 \
      --variants "$V" --kernel-tiles tokens --chain 32 --tune "m=last" \
      --json "$OUT/bench_attention_merged.json"
    python scripts/bench_ragged_attention.py --methods diffkv,bf16 --active 12,24,46 --splits 1 \
      --chain 32 --plan step \
      --variants "tokens=1,merge=8;tokens=1,merge=last;tokens=1,merge=last,wave=1584" \
      --json "$OUT/bench_ragged_merged.json" ;;
  merged-step)
    for M in pallas launch; do
      python scripts/step_breakdown.py --model llama3-8b --methods diffkv --batch 64 \
        --context 4096 --iters 5 --only-step --profile 3 --diffkv-options "merge_impl=$M" \
        --json "$OUT/step_merge_$M.json"
    done ;;
  early)
    # the fixed cost of a work item: its token counts and first table entries loaded
    # before the first tier's loop, with the launch's two merges
    python -m pytest -q -m gpu tests/test_early_row_loads.py
    V=jax-bf16,diffkv-high,diffkv-50/50,diffkv-mix
    python scripts/bench_attention.py --models llama3-8b --batches 32 --contexts 4096,16384 \
      --variants "$V" --kernel-tiles tokens --chain 32 --tune "el=1;m=last;m=last,el=1" \
      --json "$OUT/bench_attention_early_b32.json"
    python scripts/bench_attention.py --models llama3-8b --batches 128 --contexts 4096 \
      --variants "$V" --kernel-tiles tokens --chain 32 --tune "el=1;m=last;m=last,el=1" \
      --json "$OUT/bench_attention_early_b128.json" ;;
  early-step)
    for E in false true; do
      python scripts/step_breakdown.py --model llama3-8b --methods full,diffkv --batch 64 \
        --context 4096 --iters 5 --only-step --prompt 0 --profile 3 \
        --diffkv-options "early_row_loads=$E" --full-options "early_row_loads=$E" \
        --json "$OUT/step_early_$E.json"
    done ;;
  timeline)
    # where a launch's time goes that does not grow with its bytes: the programs' start,
    # loop and end times of the realistic mix at 32 x 4K (each program's prologue, loops
    # and epilogue, the ramp, the tail, the merge), with fewer items per wave, against
    # the 50/50 mix and all-high (one tier)
    python -m pytest -q -m gpu tests/test_program_trace.py
    T="python scripts/program_timeline.py --repeats 3"
    $T --settings "m=rows;m=rows,el=1;m=last;m=last,el=1;m=last,wave=528;m=last,wave=792" \
      --json "$OUT/timeline_mix_32x4k.json"
    $T --variant diffkv-50/50 --settings "m=last" --json "$OUT/timeline_5050_32x4k.json"
    $T --variant diffkv-high --settings "m=last" --json "$OUT/timeline_high_32x4k.json" ;;
  timeline-shapes)
    # the same at 32 x 16K and 128 x 4K: what grows with the context or the batch
    T="python scripts/program_timeline.py --repeats 3"
    $T --context 16384 --settings "m=rows;m=last" --json "$OUT/timeline_mix_32x16k.json"
    $T --batch 128 --settings "m=rows;m=last" --json "$OUT/timeline_mix_128x4k.json" ;;
  balance)
    # the caches' present launch traced at 32 x 4K: the multiprocessors' ends and the
    # balanced span (what sharing the work out as the launch runs could win at most),
    # with the tiers' weights and cuts on the tier boundary, and the 50/50 mix
    T="python scripts/program_timeline.py --repeats 3"
    $T --settings "m=rows;m=last;m=last,sn=30;m=last,tw=15,sn=30" \
      --json "$OUT/timeline_balance_mix_32x4k.json"
    $T --variant diffkv-50/50 --settings "m=last" --json "$OUT/timeline_balance_5050_32x4k.json" ;;
  weights|weights-b128)
    # the tiers' work units per page (8 : 15, also with cuts moved onto the tier
    # boundary) against the caches' 1 : 2, chained
    B=32; [ "$1" = weights-b128 ] && B=128
    python scripts/bench_attention.py --models llama3-8b --batches $B --contexts 4096,16384 \
      --variants jax-bf16,diffkv-50/50,diffkv-mix --kernel-tiles tokens --chain 32 \
      --tune "m=last;m=last,w=8-15;m=last,w=8-15,sn=0.3" \
      --json "$OUT/bench_attention_weights_b$B.json" ;;
  gap)
    # the second loop's start counted in the plan (plan_work(gap=)): the item across a
    # row's tier boundary holds that many units fewer; under 8 : 15 (and 8 : 16, the
    # caches' 1 : 2 in eighths), against the caches' plan; then traced
    tune_32x4k "m=last;m=last,w=8-15;m=last,w=8-15,gp=12;m=last,w=8-16,gp=12;m=last,w=8-15,gp=15" \
      "$OUT/bench_attention_gap_b32.json"
    python scripts/program_timeline.py --repeats 3 --settings "m=last;m=last,tw=15,gp=12" \
      --json "$OUT/timeline_gap_mix_32x4k.json" ;;
  chunks)
    # LaunchConfig.row_chunk: each item walks a fixed share of its row, then takes
    # chunks of the rest from the row's cursor; one and two warps per program (two
    # compile to 143 registers with cursors, 6 programs per multiprocessor: wave=792
    # plans for 6 on 132 multiprocessors); the compiled checks first, then the
    # launches chained, then traced
    pytest -q -m gpu tests/test_row_chunks.py
    tune_32x4k "m=last;m=last,nw=1;m=last,nw=1,rc=8;m=last,rc=8;m=last,rc=8,wave=792" \
      "$OUT/bench_attention_row_chunks_b32.json"
    python scripts/program_timeline.py --repeats 3 --settings "m=last;m=last,rc=4" \
      --json "$OUT/timeline_row_chunks_mix_32x4k.json" ;;
  mosaic)
    # pallas_kernels/mosaic_decode.py checked compiled, then timed beside the Triton-lowered
    # launches and JAX's kernel (on an H100 the two 16-bit kernels were level, 3.0.0za, and
    # the first K8V4 launch on Mosaic GPU 3.5x slower than the Triton one, 3.0.0zb)
    python -m pytest -q -m gpu tests/test_mosaic_decode.py
    python scripts/bench_mosaic_decode.py --pages bf16,k8v4 --batches 32,128 --contexts 4096 \
      --splits 2,4 --stages 2,4 --json "$OUT/bench_mosaic_decode.json"
    python scripts/bench_attention.py --models llama3-8b --batches 32,128 --contexts 4096 \
      --variants jax-bf16,ours-bf16,diffkv-high --kernel-tiles tokens --chain 32 \
      --tune m=last --json "$OUT/bench_attention_mosaic_peers.json" ;;
  open)
    # what is still open for the realistic mix at 32 x 4K on the H200, in one call:
    # the caches' two-warp launch against one warp (3.0.0t), row cursors at one warp
    # and at two planned for 6 programs per multiprocessor (3.0.0x), one int8 digit,
    # and two buffers of each page operand (5 pipeline stages: 28,184 bytes of shared
    # memory, 7 programs per multiprocessor, so items for 7 x 132 = 924)
    tune_32x4k "m=last;m=last,nw=1;m=last,nw=1,rc=8;m=last,rc=8,wave=792;m=last,i8=1;m=last,st=5,wave=924;m=last,nw=1,st=5,wave=924" \
      "$OUT/bench_attention_open_b32.json" ;;
  keys)
    # the key dots in int8, the query in one or two int8 digits (i8), and each step's
    # key dots taken in the step before (ka), with one and two warps; the compiled
    # checks first (on an H100 neither was faster, docs/benchmarks.md 3.0.0x)
    python -m pytest -q -m gpu tests/test_int8_keys.py tests/test_keys_ahead.py
    tune_32x4k "m=last;m=last,nw=1;m=last,i8=1;m=last,nw=1,i8=1;m=last,i8=2;m=last,ka=1;m=last,nw=1,ka=1" \
      "$OUT/bench_attention_keys_b32.json" ;;
  codes)
    # the value codes' slices left at their bit offsets (vp), each lane's metadata
    # loaded once (ms) and K4V2's 64-slot pages walked a page per step, half a page per
    # lane (sp): the compiled checks, then the launches chained
    python -m pytest -q -m gpu tests/test_values_in_place.py tests/test_split_pages.py \
      tests/test_lane_meta_select.py
    tune_32x4k "m=last,vp=0,ms=0;m=last,vp=1,ms=0;m=last,vp=1,ms=1;m=last,vp=1,ms=1,sp=1" \
      "$OUT/bench_attention_codes_b32.json" jax-bf16,diffkv-high,diffkv-50/50,diffkv-mix ;;
  codes-engine)
    # the caches' GPU tests with two of those options off (their defaults are on):
    # the module's switches set before the tests run in the same process
    python - <<'EOF'
import sys

import pytest

from diffkv_jax import diffkv_kernel_attention as dka

dka.VALUES_IN_PLACE = dka.LANE_META_SELECT = False
sys.exit(pytest.main(["-q", "-m", "gpu", "tests/test_diffkv_kernel_path.py"]))
EOF
    ;;
  registers)
    # The one-warp decode launch compiles to 196 - 223 registers: 8 programs per
    # multiprocessor; 12 need at most 168, 14 (its shared memory's limit) at most 128.
    # Under jax 0.11 a Pallas Triton kernel is XLA's Triton custom call, so XLA's ptxas
    # flags reach it, but ptxas ignores --maxrregcount for PTX that fixes its block
    # size (.reqntid) unless --override-directive-values. The flags apply to every
    # kernel of the process. The launch records printed say what each compile got.
    # First, without a cap (the baseline of the same machine): one warp per program
    # against two (the caches' launch at head dim 128 since docs/benchmarks.md 3.0.0t;
    # 127 registers: the same 8 programs, twice the warps in flight).
    python scripts/bench_attention.py --models llama3-8b --batches 32 --contexts 4096 \
      --variants jax-bf16,diffkv-50/50,diffkv-mix --kernel-tiles tokens --chain 32 \
      --tune "m=last,nw=1;m=last" --json "$OUT/bench_attention_nocap_b32.json"
    for CAP in ${REG_CAPS:-168 128}; do
      W=1584; [ "$CAP" -le 128 ] && W=1848
      XLA_FLAGS="--xla_gpu_ptx_compiler_extra_flags='--maxrregcount=$CAP --override-directive-values'" \
        python scripts/bench_attention.py --models llama3-8b --batches 32 --contexts 4096 \
        --variants jax-bf16,diffkv-50/50,diffkv-mix --kernel-tiles tokens --chain 32 \
        --tune "m=last,nw=1,wave=$W" --json "$OUT/bench_attention_xlacap${CAP}_b32.json"
    done ;;
  smollm2)
    # SmolLM2-135M's heads (9 q / 3 KV, d = 64) with the caches' launch: token tiles, the
    # one-wave plan, the merge in its own launch and inside the decode launch
    python scripts/bench_attention.py --models smollm2-135m --batches 32,128 \
      --contexts 4096,16384 --kernel-tiles tokens --chain 32 --tune "m=last" \
      --json "$OUT/bench_attention_smollm2.json" ;;
  ragged)
    python scripts/bench_ragged_attention.py --json "$OUT/bench_ragged_attention.json" ;;
  policy)
    python scripts/bench_policy_launch.py --active 1,12,46 --variants "lanes=1;merge=0;splits=8" \
      --json "$OUT/bench_policy_launch.json" ;;
  parts)
    python scripts/bench_launch_parts.py --json "$OUT/bench_launch_parts.json" ;;
  scoring)
    python scripts/bench_window_scores.py --profile --iters 20 --json "$OUT/window_scores.json"
    python scripts/step_breakdown.py --model llama3-8b --methods none --prompt 4096 \
      --json "$OUT/prompt_scoring.json" ;;
  allocation)
    python scripts/bench_page_allocation.py --json "$OUT/page_allocation.json" ;;
  *)
    echo "usage: $0 tests|breakdown|diffkv|full|compare|attention|merged|merged-step|early|early-step|timeline|timeline-shapes|balance|weights|weights-b128|gap|chunks|open|keys|codes|codes-engine|registers|smollm2|ragged|parts|policy|scoring|allocation" >&2
    exit 2 ;;
esac
