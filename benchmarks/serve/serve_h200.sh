#!/usr/bin/env bash
# `wise serve` under load on one H200, the server and the load client on the same machine:
#   bash benchmarks/serve/prepare-serve-wheels.sh     # once, with network: aiohttp wheels into .whl-serve/
#   bash benchmarks/serve/serve_h200.sh OUTDIR        # on the H200, .whl-serve/ carried with the tree
# Per arm (dense, WISE): Ouro-1.4B shape with random bf16 weights made on the GPU, q_proj x8
# (reuse-union density about 0.28 at 1K); 1K-token prompts, 128 output tokens (ignore_eos), a
# pool of 640 pages of 128 tokens (64 requests of 1,152 tokens take 576). First the offline engine
# on the workload (the baseline: every request queued at once, 64 decoding), then the server with
# benchmarks.serve.serve_load at concurrency 64, then at a fixed rate; each in a fresh process. OUTDIR gets the
# logs, a serve_load-*.json/.md/.png per run, the server's last /metrics and summary.md.
# ARMS="dense wise spec" adds lossless speculative decoding (WISE drafts of 4 tokens);
# REQUESTS, RATE, CONCURRENCY, PROMPT and OUTPUT change the workload, ENGINE the engine flags;
# MAX_MODEL_LEN sets the engine's --max-model-len (default: the model's limit within the pool, 65,536
# here, which the decode kernels' split grids and the WISE block tables are sized by).
set -uo pipefail
out=$1
cd "$(dirname "$0")/../.."
mkdir -p "$out"
if ! python3 -c "import aiohttp" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/wise-serve-pkgs .whl-serve/*.whl || exit 3
  export PYTHONPATH=/tmp/wise-serve-pkgs${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
port=${PORT:-8000}; url=http://127.0.0.1:$port; requests=${REQUESTS:-128}; rate=${RATE:-6}; c=${CONCURRENCY:-64}
engine=${ENGINE:-"--model ouro-1.4b --load-format dummy --q-scale 8 --num-pages 640 --max-num-seqs $c --seed 0${MAX_MODEL_LEN:+ --max-model-len $MAX_MODEL_LEN}"}
load="--prompt-len ${PROMPT:-1024} --output-len ${OUTPUT:-128} --ignore-eos"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import sys,torch,aiohttp;print(sys.version.split()[0],'torch',torch.__version__,'aiohttp',aiohttp.__version__)"
  date -u +%FT%TZ; } > "$out/machine.txt" 2>&1
for arm in ${ARMS:-dense wise}; do
  case $arm in
    dense) flags=$engine;;
    wise) flags="$engine --wise";;
    spec) flags="$engine --speculative wise --num-draft 4";;
    *) echo "unknown arm $arm (dense|wise|spec)"; continue;;
  esac
  echo "== $arm: offline engine"
  timeout 240 python3 -m benchmarks.serve.serve_load --offline $flags --num-requests "$requests" --concurrency "$c" $load \
    --out "$out" --label "$arm-offline" > "$out/$arm-offline.log" 2>&1; tail -n 4 "$out/$arm-offline.log"
  python3 -m wise_serve $flags --port $port --log-level warning > "$out/$arm-server.log" 2>&1 &
  pid=$!
  python3 -c "import sys; from benchmarks.serve import serve_load; serve_load.wait_ready(sys.argv[1], 180)" \
    "$url" || { echo "server did not start"; tail "$out/$arm-server.log"; kill $pid; continue; }
  echo "== $arm: server at concurrency $c"
  timeout 240 python3 -m benchmarks.serve.serve_load --url "$url" --num-requests "$requests" --concurrency "$c" $load \
    --out "$out" --label "$arm-conc" > "$out/$arm-conc.log" 2>&1; tail -n 5 "$out/$arm-conc.log"
  echo "== $arm: server at $rate req/s"
  timeout 240 python3 -m benchmarks.serve.serve_load --url "$url" --num-requests "$requests" --rate "$rate" $load \
    --warmup-requests 0 \
    --out "$out" --label "$arm-rate" > "$out/$arm-rate.log" 2>&1; tail -n 5 "$out/$arm-rate.log"
  python3 -c "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1]).read().decode())" \
    "$url/metrics" > "$out/$arm-metrics.txt"
  kill -TERM $pid; wait $pid; echo "== $arm: server exit $?"
done
python3 -c "import sys; from benchmarks.serve import serve_load; print(serve_load.summary_table(sys.argv[1]))" \
  "$out" | tee "$out/summary.md"
