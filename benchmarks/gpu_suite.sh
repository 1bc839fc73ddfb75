#!/usr/bin/env bash
# Every GPU test and benchmark of the project, in parts, for one H200 (tp: two):
#   bash benchmarks/gpu_suite.sh tests1|tests2|tests3|tests4|tests-parity|tests-summary|train|bench|engine|jax|jax-bench|jax-tests|huginn|step-profile|stalls|pallas|pallas-sweep|kernel-profile|tp|fa4|prefix|long|drafts OUTDIR [MODEL_DIR]
# tests1 .. tests4: the `gpu`-marked pytest suite in four parts of about 8 minutes each (one 10-minute call each;
#        benchmarks.gpu_tests --part K/4: the files where pytest collects a gpu test, balanced by their
#        FILE_SECONDS, each file in a process of its own, so a CUDA fault in one cannot fail the rest) into
#        OUTDIR/gpu_tests_K; tests-parity: the parity suite (`python3 -m parity`, full shapes; on an H100 9 of its 12
#        checks took 150 s, end-to-end about 100 s more on an H200, the two Huginn checks 74 s on a CPU with the
#        references alone) as one row under a 540 s limit, into OUTDIR/gpu_tests_parity; tests-summary (no GPU:
#        run it where the five parts' folders sit together under OUTDIR): one table of every file and parity
#        (passed / failed / errors / skipped, the failures and every skip with its reason, the card, versions,
#        date and commit), printed and written to OUTDIR/gpu_tests.md and .json -- give an OUTDIR under
#        benchmarks/results/ to commit it;
# train: trains the built-in model (benchmarks.train.train_builtin) into OUTDIR/model; TRAIN_ARCHITECTURES="huginn"
#        trains the built-in Huginn model into OUTDIR/huginn-model instead, "ouro huginn" both (two 10-minute
#        slots at the default TRAIN_MINUTES=5; TRAIN_MINUTES=3 fits both in one);
# engine: the torch engine's gpu tests, the fused-ops benchmark and the engine throughput
#         benchmark (dense and WISE at 1K x 64, 4K x 20, 8K x 10, 1K x 1; ARMS, SHAPES, Q_SCALES override;
#         SPEC adds speculative arms, e.g. SPEC="--spec wise --spec loops --num-draft 4");
# jax: jax-bench then jax-tests (two 10-minute slots); jax-bench: the JAX engine's throughput benchmark
#      (dense and WISE at 1K x 64, 4K x 20, 8K x 10, 1K x 1; a 32K x 2 prefill; JAX_ARMS, SHAPES,
#      Q_SCALES override; each (shape, arm) warms up for about 40 s; JAX_PER_SHAPE=SECONDS: one invocation and
#      report per shape under that limit, each arm's process JAX_CHILD seconds (default 150), no prefill shape);
#      jax-tests: JAX's gpu tests (engine,
#      selection in generate, the Pallas kernel in generate, parity's kernel checks) and the decode
#      contract compiled for the GPU;
# huginn: the Huginn-3.5B shape (huginn-0125, random bf16 weights) through both engines at r = 32 core
#         iterations, dense, WISE and adaptive depth at 1K x 32 and 4K x 8 (HUGINN_ARMS overrides; four
#         10-minute slots, one per engine and shape: HUGINN_ENGINES=torch|jax and HUGINN_SHAPES=1k|4k pick one;
#         the part's comment says more);
# step-profile: where a decode step's time goes, torch and JAX, dense and WISE, constructor defaults
#               (benchmarks.profile.step_profile at 1K x 64 and 1K x 1; SHAPES, Q_SCALES, FRAMEWORKS override),
#               about 5 minutes;
# stalls: issue 45's start-up and stall targets, both engines with their constructor defaults
#         (benchmarks.engine.compile_stalls, Ouro-1.4B shape, random bf16 weights): the first token of a 1K prompt
#         from a cold start (empty compile cache) and a warm one, and a batch shrinking from 64 to 1 (the longest
#         step, steps that waited for a compile); a fresh process per measurement, 170 s each, torch first (its
#         three expected within about 2 minutes), JAX in the rest of one slot (FRAMEWORKS overrides); not yet
#         timed on a GPU: a process that runs out of time says "timed out" in the report;
# pallas: both Pallas kernels' gpu tests (Triton-lowered, Mosaic GPU) and the kernel benchmark, about 4 minutes;
# pallas-sweep: the kernel benchmark with both Pallas kernels' launch sweeps (PALLAS_SWEEP seconds per kernel
#               and shape, default 40: about 2 + 0.1 x PALLAS_SWEEP minutes);
# kernel-profile: each kernel of a Pallas decode-attention call under the profiler (both kernels, every
#                 mode, the Ouro shapes; SHAPES, IMPLS override), about 3 minutes;
# tp: on a host with two GPUs, the tensor-parallel gpu tests (torch and JAX) and the scaling benchmarks
#     (1 and 2 GPUs, dense and WISE, Ouro-1.4B shape at 1K x 64 and 8K x 20: torch's benchmarks.engine.tp_scaling, JAX's
#     +tp2 arms); NCCL_NVLS_ENABLE=0 (NVLink multicast off); each `run` fits a 10-minute slot;
# fa4: FlashAttention-4 from the wheels in .whl-fa4 (parts a and b stashed by their stash.sh in earlier
#      calls on the same machine; this part runs part c's install.sh when it is there), then its gpu tests
#      (packed varlen prefill and dense decode against SDPA / Triton, the union WISE arm) and the prefill
#      benchmark (SDPA and FA4, whole prompts and 2,048-token chunks, 1K x 64 to 32K x 2), then decode
#      throughput of dense, WISE, fa4 and wise-fa4 (the FlashAttention WISE arm), about 18 minutes;
# prefix: prefix caching on and off on a shared-system-prompt workload (64 requests, a 1,024-token common
#         prefix, 128 own tokens), torch and JAX, Ouro-1.4B shape, random bf16 weights;
# long: batch 1 at 32K and 64K contexts, dense and WISE defaults, torch then JAX (LONG_SHAPES="SHAPE:QSCALE ...",
#       FRAMEWORKS pick), each engine and shape in one invocation of 280 s: two 10-minute slots;
# drafts: each speculative draft kind on the trained built-in model (bf16, CUDA graphs): acceptance,
#         tokens per round, tokens against dense;
# bench: the kernel benchmark (Triton, Pallas, cuDNN SDPA, FlashAttention-4 when importable) and
#        the WISE quality run on MODEL_DIR when given.
# Every part on a GPU first measures the card's copy bandwidth (OUTDIR/bandwidth.json), the engine benchmarks'
# roofline (--hbm-tbps). Logs and results go to OUTDIR. The project runs from the source tree (PYTHONPATH), the benchmarks as
# `python3 -m benchmarks.GROUP.NAME` from its root.
set -uo pipefail
part=$1; out=$2; model=${3:-}
cd "$(dirname "$0")/.."
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
run() {  # run NAME SECONDS CMD...: log to OUTDIR/NAME.log, keep going on failure
  local name=$1 secs=$2; shift 2
  echo "== $name: $*"
  timeout "$secs" "$@" > "$out/$name.log" 2>&1
  echo "== $name exit $?  ($(tail -n 1 "$out/$name.log"))"
}
hbm=4.3   # the roofline's bandwidth, TB/s: the card's copy bandwidth, measured below on a GPU
if [ "$part" != tests-summary ]; then   # the summary runs where the parts came back, not on the GPU
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import sys,torch,triton,jax;print(sys.version.split()[0],'torch',torch.__version__,'triton',triton.__version__,'jax',jax.__version__)"
    date -u +%FT%TZ; git log -1 --format=%h 2>/dev/null; } > "$out/machine.txt" 2>&1
  if python3 -m benchmarks.bandwidth --json "$out/bandwidth.json" >> "$out/machine.txt" 2>&1; then
    hbm=$(python3 -c "import json;print(json.load(open('$out/bandwidth.json'))['tbps'])")
  fi
fi
case $part in
  tests1|tests2|tests3|tests4)
    k=${part#tests}
    run "gpu_tests_$k" 570 python3 -m benchmarks.gpu_tests --part "$k/4" --out "$out/gpu_tests_$k"
    ;;
  tests-parity)
    run gpu_tests_parity 570 python3 -m benchmarks.gpu_tests --parity 540 --out "$out/gpu_tests_parity"
    ;;
  tests-summary)
    python3 -m benchmarks.gpu_tests --summarize "$out"/gpu_tests_*/ --out "$out"
    ;;
  train)
    for arch in ${TRAIN_ARCHITECTURES:-ouro}; do
      if [ "$arch" = ouro ]; then name=train dir=model; else name=train_$arch dir=$arch-model; fi
      run "$name" 540 python3 -m benchmarks.train.train_builtin --architecture "$arch" --minutes "${TRAIN_MINUTES:-5}" \
          --out "$out/$dir"
    done
    ;;
  bench)
    run kernel_bench 330 python3 -m benchmarks.kernels.kernel_bench --out "$out/kernel" --sweep-seconds 90
    if [ -n "$model" ]; then
      run quality 120 python3 -m benchmarks.quality.evaluate text --model "$model" --out "$out/quality" --quiet
    fi
    ;;
  engine)
    run torch_gpu_tests 420 python3 -m pytest -q -m gpu tests/wise_torch/test_torch_gpu.py tests/wise_torch/test_layers.py \
        tests/wise_torch/test_fused_compile.py tests/wise_torch/test_triton_decode.py tests/wise_torch/test_torch_speculative_gpu.py \
        -p no:cacheprovider -rfE -s
    run fused_ops 120 python3 -m benchmarks.kernels.fused_ops_bench --out "$out/fused_ops"
    run throughput 540 python3 -m benchmarks.engine.throughput --preset ouro-1.4b --arms "${ARMS:-dense,wise}" \
        --shapes "${SHAPES:-1024x64,4096x20,8192x10,1024x1}" --q-scale "${Q_SCALES:-8,7.3,7,8}" \
        --max-num-batched-tokens 81920 --hbm-tbps "$hbm" ${OLD_SRC:+--old-src "$OLD_SRC"} ${SPEC:-} --out "$out/throughput"
    ;;
  jax|jax-bench|jax-tests)
    if [ "$part" != jax-tests ] && [ -n "${JAX_PER_SHAPE:-}" ]; then
      # one invocation (and report) per shape, so that a shape that fails or runs long loses only its own rows
      IFS=, read -ra jshapes <<< "${SHAPES:-1024x64,4096x20,8192x10,1024x1}"
      IFS=, read -ra jscales <<< "${Q_SCALES:-8,7.3,7,8}"
      for i in "${!jshapes[@]}"; do
        run "jax_throughput_${jshapes[$i]}" "$JAX_PER_SHAPE" python3 -m benchmarks.engine.jax_generate_bench --preset ouro-1.4b \
            --arms "${JAX_ARMS:-dense,wise}" --shapes "${jshapes[$i]}" --q-scale "${jscales[$i]}" --hbm-tbps "$hbm" \
            --child-timeout "${JAX_CHILD:-150}" --compile-cache "$out/jax-cache" --out "$out/jax_throughput_${jshapes[$i]}"
      done
    elif [ "$part" != jax-tests ]; then
      run jax_throughput 560 python3 -m benchmarks.engine.jax_generate_bench --preset ouro-1.4b --arms "${JAX_ARMS:-dense,wise}" \
          --shapes "${SHAPES:-1024x64,4096x20,8192x10,1024x1}" --q-scale "${Q_SCALES:-8,7.3,7,8}" --hbm-tbps "$hbm" \
          --prefill-shapes 32768x2 --child-timeout 150 --out "$out/jax_throughput"
    fi
    if [ "$part" != jax-bench ]; then
      run jax_gpu_tests 240 python3 -m pytest -q -m gpu tests/wise_jax/test_jax_gpu.py tests/wise_jax/test_jax_selection_in_generate.py \
          tests/parity/test_kernels_in_generate_gpu.py tests/parity/test_parity_gpu.py -p no:cacheprovider -rfE --durations=10
      run decode_contract 120 python3 -m pytest -q tests/parity/test_decode_contract.py -p no:cacheprovider -rfE
    fi
    ;;
  huginn)
    # huginn-0125's shape (2-layer prelude, 4-layer core block, 2-layer coda; hidden 5280, 55 heads of 96) at
    # r = 32 core iterations; the wise arms' profile is huginn_wise_config(32): discovery on iterations 0 and 1,
    # reuse on 2..31, eta 0.95, blocks of 32 tokens (the report states it, and the measured density).
    # Memory: (2 + 4 x 32 + 2) = 132 K/V planes x 2 x 5280 bf16 values = 2.8 MB a token, ~93 GB of K/V at
    # 1K x 32 and at 4K x 8, with 7 GB of weights: only an H200 holds it.
    # --q-scale 3.1 / 2.83 is not calibrated for Huginn (the run reports the density it gets): on these random
    # weights a query's attention logits have std ~ std^2 x hidden x q_scale (q and k entries ~ N(0, std^2 x
    # hidden) on unit-RMS inputs; the head_dim sum and its 1/sqrt(head_dim) cancel), so Ouro-1.4B's calibration
    # (x8 / x7.3 at 1K / 4K, hidden 2048: reuse density 0.287 / 0.174) carried to hidden 5280 is x3.1 / x2.83.
    # Kernel: "auto" (HUGINN_KERNEL overrides; "reference" gives the reference decode, which reads every key in
    # every mode): the Triton decode kernel (torch) and the Pallas one (JAX) take head_dim 96 on 128-lane tiles,
    # the padded lanes masked (any multiple of 16); Mosaic's needs a multiple of 64, so the JAX part runs
    # Pallas' Triton lowering. Their launch configuration for 96 is head_dim 128's, not tuned for 96.
    # Arms: dense, wise and adaptive (AdaptiveDepth's default KL threshold, 1e-3: its exited rows ride along,
    # every iteration runs, so it shows the exits' cost and its measured mean depth, not a saving); one `run` per
    # engine and shape, each arm's process given 540 s / the arms: 180 s for the three (an adaptive arm's JAX
    # decode program holds the exit checks, a coda and head per iteration, on top of dense's); HUGINN_ARMS=
    # dense,wise,adaptive,wise-adaptive gives each 135 s, what dense and wise had when both shapes shared a slot.
    # Not yet timed on an H200: a row that runs out of time says "timed out".
    huginn_arms=${HUGINN_ARMS:-dense,wise,adaptive}
    child=$((540 / ($(tr -cd , <<< "$huginn_arms" | wc -c) + 1)))
    engines=${HUGINN_ENGINES:-torch,jax} shapes=${HUGINN_SHAPES:-1k,4k}
    for shape in 1024x32:3.1:1k 4096x8:2.83:4k; do
      IFS=: read -r dims scale tag <<< "$shape"
      [[ ",$shapes," == *",$tag,"* ]] || continue
      if [[ ",$engines," == *",torch,"* ]]; then
        run "huginn_throughput_$tag" 560 python3 -m benchmarks.engine.throughput --preset huginn-0125 --num-steps 32 \
            --arms "$huginn_arms" --shapes "$dims" --q-scale "$scale" --kernel "${HUGINN_KERNEL:-auto}" \
            --child-timeout "$child" --out "$out/huginn_throughput_$tag"
      fi
      if [[ ",$engines," == *",jax,"* ]]; then
        run "huginn_jax_throughput_$tag" 560 python3 -m benchmarks.engine.jax_generate_bench --preset huginn-0125 \
            --num-steps 32 --arms "$huginn_arms" --shapes "$dims" --q-scale "$scale" --kernel "${HUGINN_KERNEL:-auto}" \
            --child-timeout "$child" --out "$out/huginn_jax_throughput_$tag"
      fi
    done
    ;;
  step-profile)
    run step_profile 560 python3 -m benchmarks.profile.step_profile --frameworks "${FRAMEWORKS:-torch,jax}" \
        --shapes "${SHAPES:-1024x64,1024x1}" --q-scale "${Q_SCALES:-8,8}" --child-timeout 150 --out "$out/step_profile"
    ;;
  stalls)
    run compile_stalls 560 python3 -m benchmarks.engine.compile_stalls --preset ouro-1.4b \
        --engines "${FRAMEWORKS:-torch,jax}" --child-timeout 170 --out "$out/compile_stalls"
    ;;
  pallas)
    run pallas_gpu_tests 150 python3 -m pytest -q -m gpu tests/wise_jax/test_pallas_decode.py tests/wise_jax/test_mosaic_decode.py \
        tests/wise_jax/test_pallas_lowering.py -p no:cacheprovider -rfE --durations=10
    run kernel_bench 180 python3 -m benchmarks.kernels.kernel_bench --out "$out/kernel" --no-sweep --densities 0.13 \
        --pallas-chain 2,16 --no-jax-paged
    ;;
  pallas-sweep)
    sweep=${PALLAS_SWEEP:-40}
    run kernel_bench_sweep $((120 + 6 * sweep)) python3 -m benchmarks.kernels.kernel_bench --out "$out/kernel_sweep" --no-sweep \
        --densities 0.13 --pallas-chain 2,16 --no-jax-paged --pallas-sweep-seconds "$sweep"
    ;;
  kernel-profile)
    run kernel_profile 300 python3 -m benchmarks.profile.kernel_profile --out "$out/kernel_profile" \
        --shapes "${SHAPES:-1024x64,4096x20,8192x10}" --impls "${IMPLS:-pallas,mosaic}"
    ;;
  tp)
    export NCCL_NVLS_ENABLE=0
    run tp_gpu_tests 540 python3 -m pytest -q -m gpu tests/wise_torch/test_torch_tensor_parallel_gpu.py tests/wise_jax/test_jax_sharding_gpu.py \
        -p no:cacheprovider -rfE -s
    run tp_scaling_1k 540 python3 -m benchmarks.engine.tp_scaling --preset ouro-1.4b --shapes 1024x64 --q-scale 8 \
        --child-timeout 240 --out "$out/tp_scaling_1k"
    run tp_scaling_8k 540 python3 -m benchmarks.engine.tp_scaling --preset ouro-1.4b --shapes 8192x20 --q-scale 7 \
        --child-timeout 240 --out "$out/tp_scaling_8k"
    run tp_jax 540 python3 -m benchmarks.engine.jax_generate_bench --preset ouro-1.4b --arms dense,dense+tp2,wise,wise+tp2 \
        --shapes 1024x64,8192x20 --q-scale 8,7 --child-timeout 120 --out "$out/tp_jax"
    ;;
  fa4)
    if [ -f .whl-fa4/c/install.sh ]; then run fa4_install 240 bash .whl-fa4/c/install.sh; fi
    export PYTHONPATH=/tmp/fa4:/tmp/fa4/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
    run fa4_gpu_tests 180 python3 -m pytest -q -m gpu tests/wise_torch/test_torch_prefill_varlen.py \
        tests/wise_torch/test_torch_union_decode.py -p no:cacheprovider -rfE
    run prefill_bench 360 python3 -m benchmarks.engine.prefill_bench --out "$out/prefill"
    run fa4_decode 560 python3 -m benchmarks.engine.throughput --preset ouro-1.4b --arms dense,wise,fa4,wise-fa4 \
        --shapes 1024x64,4096x20,8192x10 --q-scale 8,7.3,7 --out "$out/fa4_decode"
    ;;
  prefix)
    run prefix_cache 560 python3 -m benchmarks.engine.prefix_cache --preset ouro-1.4b --engines "${FRAMEWORKS:-torch,jax}" \
        --timeout 270 --out "$out/prefix_cache"
    ;;
  long)
    # batch 1 at long contexts (issue 48): K/V is most of a step's bytes, where WISE's reuse loops count most;
    # 65,504 prompt tokens + 32 new = the model's 65,536 positions
    for shape_scale in ${LONG_SHAPES:-32768x1:6.5 65504x1:6.2}; do
      shape=${shape_scale%%:*}; scale=${shape_scale##*:}
      if [ "${FRAMEWORKS:-torch,jax}" != jax ]; then
        run "long_torch_$shape" 280 python3 -m benchmarks.engine.throughput --preset ouro-1.4b --arms dense-default,wise-default \
            --shapes "$shape" --q-scale "$scale" --hbm-tbps "$hbm" --child-timeout 135 --out "$out/long_torch_$shape"
      fi
      if [ "${FRAMEWORKS:-torch,jax}" != torch ]; then
        run "long_jax_$shape" 280 python3 -m benchmarks.engine.jax_generate_bench --preset ouro-1.4b --arms dense-default,wise-default \
            --shapes "$shape" --q-scale "$scale" --hbm-tbps "$hbm" --child-timeout 135 --compile-cache "$out/jax-cache" \
            --out "$out/long_jax_$shape"
      fi
    done
    ;;
  drafts)
    run draft_kinds 300 python3 -m benchmarks.engine.draft_kinds --dtype bfloat16 --prompts 64 --length 256 \
        --new-tokens 128 --out "$out/draft_kinds"
    ;;
  *) echo "unknown part $part (tests1|tests2|tests3|tests4|tests-parity|tests-summary|train|bench|engine|jax|jax-bench|jax-tests|huginn|step-profile|stalls|pallas|pallas-sweep|kernel-profile|tp|fa4|prefix|long|drafts)" >&2; exit 2;;
esac
