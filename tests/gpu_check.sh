#!/usr/bin/env bash
# The GPU checks in one go, for a machine with one GPU and no network (under 9 minutes on one H200):
# tests/test_gpu.py, then bench.py at the 0.5B Qwen2 shape, beside TRL 1.12's PPOTrainer when its
# baseline script is at hand, then the precision rows. Figures go to one JSON file, $OUT/gpu_check.json (else runs/gpu_check.json).
# Without a GPU it says so and stops cleanly, so it is safe anywhere (CI never has a GPU).
#
# From the checkout:  bash tests/gpu_check.sh  (a machine without network: the wheels it lacks in .gpu-wheels/,
# and TRL's PPO baseline script there for the side-by-side row; docs/gpu.md)
set -uo pipefail
cd "$(dirname "$0")/.."
out_dir=${OUT:-runs}
mkdir -p "$out_dir"
json="$out_dir/gpu_check.json"
export PYTHONUNBUFFERED=1 GPU_CHECK_JSON="$json"
rm -f "$json"

if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check.sh: no CUDA GPU here; nothing to check (tests/test_gpu.py skips too)"
    echo '{"skipped": "no CUDA GPU"}' > "$json"
    exit 0
fi
if ls .gpu-wheels/*.whl > /dev/null 2>&1; then  # what the GPU machines lack: tyro, datasets, trl
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu-site .gpu-wheels/*.whl \
        && export PYTHONPATH=/tmp/gpu-site:${PYTHONPATH:-}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out_dir/gpu.txt"
python3 - "$json" <<'EOF'
import json, sys, torch, transformers
json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "transformers": transformers.__version__}, open(sys.argv[1], "w"), indent=1)
EOF

status=0
timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -s 2>&1 | tee "$out_dir/test_gpu.log" \
    || status=1

trl=()
if [ -f .gpu-wheels/trl_ppo_baseline.py ] && python3 -c "import trl" 2> /dev/null; then
    trl=(--trl-python python3 --trl-script .gpu-wheels/trl_ppo_baseline.py)
fi
python3 tests/test_gpu.py > /dev/null  # the 0.5B checkpoints (already built by the tests)
timeout 240 python3 bench.py --model runs/gpu/qwen2-0.5b/policy --reward-model runs/gpu/qwen2-0.5b/reward \
    --dataset runs/gpu/prompts.jsonl --batch-size 32 --response-length 128 --num-minibatches 2 --updates 3 \
    --micro-batch-size 8 --max-prompt-length 64 --eval-fraction 0 --learning-rate 1e-6 "${trl[@]}" \
    2>&1 | tee "$out_dir/bench.log" || status=1
python3 - "$json" "$out_dir/bench.log" <<'EOF'
import json, sys
data = json.load(open(sys.argv[1]))
lines = [l for l in open(sys.argv[2]) if l.startswith("{")]
data["bench_qwen2_0.5b"] = json.loads(lines[-1]) if lines else "bench.py failed: see bench.log"
json.dump(data, open(sys.argv[1], "w"), indent=1)
EOF
# the precision rows (issue 44): log-probs under bf16, bf16 with --fp32-head and fp16 against fp32, and HF's sampler
# against the trainer under each, at the 0.5B shape (experiments/precision.py; its vLLM row needs vLLM, not here)
timeout 180 python3 experiments/precision.py --model runs/gpu/qwen2-0.5b/policy --dataset runs/gpu/prompts.jsonl \
    --reward-model runs/gpu/qwen2-0.5b/reward --no-vllm --no-speed --json "$json" 2>&1 | tee "$out_dir/precision.log" \
    || status=1
echo "gpu_check.sh: figures in $json (exit $status)"
exit $status
