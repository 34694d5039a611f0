#!/usr/bin/env bash
# The CUDA checks of issue 33, run from the repository root on a GPU machine that has CUDA, torch
# and python3 but no network: its missing Python packages come as wheels in .gpu/whl, SmolLM2's
# tokenizer and config in .gpu/smollm2 (the model's weights are not carried: checkpoints of real
# shapes are made there with random weights). Writes gpu_check.log, tests.log and results.tar.gz
# (the benchmarks' JSON) to $OUT.
#
#   1. the correctness tests on CUDA: greedy against transformers on the same device, float32,
#      every architecture, with preemption, chunked prefill and prefix caching;
#   2. benchmarks on CUDA (bfloat16): W1 offline with CUDA graphs and without, against
#      transformers' generate; one stream of 32 + 128 tokens; W1 over HTTP at 64 streams; the
#      same offline figures for a model of Llama 3.2 1B's shape.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
RESULTS=/tmp/gpu-results
MODELS=/tmp/gpu-models
mkdir -p "$RESULTS" "$MODELS"
exec > >(tee "$OUT/gpu_check.log") 2>&1

if [ -d .gpu/whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .gpu/whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src:$PWD/tests:${PYTHONPATH:-}
# USE_HUB_KERNELS=0: transformers runs its own torch layers, not kernels fetched from the hub.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false USE_HUB_KERNELS=0
PS="python3 -m pagedserve.cli"
echo "== $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, torch.cuda.get_device_name(), '| transformers', transformers.__version__)"

echo "== random-weight checkpoints of real shapes (bfloat16), SmolLM2's tokenizer"
python3 - "$MODELS" <<'PY'
import shutil, sys
from pathlib import Path
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

root = Path(sys.argv[1])
smol = AutoConfig.from_pretrained(".gpu/smollm2")
llama_1b = LlamaConfig(  # Llama 3.2 1B's shape, with SmolLM2's vocabulary
    vocab_size=smol.vocab_size, hidden_size=2048, intermediate_size=8192,
    num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
    max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=1e-5,
    bos_token_id=1, eos_token_id=2,
    rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0,
                         low_freq_factor=1.0, high_freq_factor=4.0,
                         original_max_position_embeddings=8192),
)
for name, config in (("smollm2-135m", smol), ("llama3.2-1b-shape", llama_1b)):
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(root / name)
    for file in Path(".gpu/smollm2").glob("*"):
        if file.name != "config.json":
            shutil.copy(file, root / name / file.name)
    print(name, sum(p.numel() for p in model.parameters()) / 1e6, "M parameters")
PY

echo "== tests on CUDA"
PAGEDSERVE_TEST_TOKENIZER_DIR=$PWD/.gpu/smollm2 timeout 180 python3 -m pytest -q \
    -p no:cacheprovider -n 12 -m "not cpu_only" -rfE tests/test_correctness.py tests/test_models.py \
    tests/test_prefix_caching.py tests/test_engine_behaviour.py tests/test_block_sharing.py \
    tests/test_batch_invariance.py > "$OUT/tests.log" 2>&1
echo "pytest exit $?"; tail -n 60 "$OUT/tests.log"

bench() {  # name, timeout, arguments of `pagedserve bench`
    local name=$1 limit=$2
    shift 2
    echo "== bench $name"
    timeout "$limit" $PS bench "$@" --result-file "$RESULTS/$name.json" 2>&1 |
        grep -vE "INFO|it/s]"
}
SMOL=$MODELS/smollm2-135m
W1="throughput --dataset w1 --max-num-seqs 64 --kv-cache-memory 16GiB"
ONE="throughput --dataset random --num-prompts 1 --input-len 32 --output-len 128"
bench w1-135m 120 $W1 --model "$SMOL" --baseline transformers --baseline-batch-sizes 64
bench w1-135m-eager 120 $W1 --model "$SMOL" --enforce-eager
bench single-135m 120 $ONE --model "$SMOL" --baseline transformers --baseline-batch-sizes 1

echo "== bench http-135m: W1 over HTTP, 64 streams"
$PS serve --model "$SMOL" --max-num-seqs 64 --kv-cache-memory 16GiB --port 8000 \
    > /tmp/server.log 2>&1 &
SERVER=$!
python3 - <<'PY'
import time, urllib.request
for _ in range(240):
    try:
        urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=1)
        break
    except OSError:
        time.sleep(0.5)
PY
timeout 120 $PS bench serve --dataset w1 --max-concurrency 64 --no-progress \
    --result-file "$RESULTS/http-135m-warmup.json" > /dev/null 2>&1
timeout 120 $PS bench serve --dataset w1 --max-concurrency 64 --no-progress \
    --result-file "$RESULTS/http-135m.json" 2>&1 | grep -v INFO
kill $SERVER
grep -iE "error|traceback" /tmp/server.log | head -5

BIG=$MODELS/llama3.2-1b-shape
bench w1-1b 180 $W1 --model "$BIG" --baseline transformers --baseline-batch-sizes 64
bench single-1b 120 $ONE --model "$BIG" --baseline transformers --baseline-batch-sizes 1

tar -czf "$OUT/results.tar.gz" -C "$RESULTS" .
echo "== done $(date -u +%FT%TZ)"
