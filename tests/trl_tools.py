"""Record what TRL 1.12's GRPOTrainer with `tools=` renders and parses, as a fixture: tests/trl_tools.json.

TEST-ONLY, like tests/trl_distill.py: TRL is no requirement of this project. Issue 64 asks that `--tools` give the
model the same prompt as TRL's `tools=` and read the same calls from the same outputs; test_tools.py holds ppo.py
and tools.py to what this records.

Reproduce from the repo root, in a virtualenv of its own outside the repo (CPU is enough):
    python3.11 -m venv VENV
    VENV/bin/pip install torch==2.13.0
    VENV/bin/pip install trl==1.12.0 torch==2.13.0 requests
    VENV/bin/python tests/trl_tools.py

The trainer is TRL's own, built on a tiny random Qwen2 model with the real Qwen2 tokenizer (tests/tokenizers) and
smollm2.TOOLS_TEMPLATE, the template of the tool task; `tools=[calculator, add]`. TRL knows no response
parser for a template it has not seen, so the tokenizer is given TRL's Qwen 3 response template (the Hermes form,
which this template writes), as a TRL user with this template would. Recorded, through the trainer's own methods:
- `prompts`: the ids `_tokenize_prompts` renders for the first rows of the tool task and for a bare question;
- `outputs`: for each output, a sampled turn ending in <|im_end|>, the calls TRL's `parse_response` reads (the
  trainer's parse, with its fallback to plain text when parsing fails);
- `tool_suffix`: the ids `_get_tool_suffix_ids` appends after a turn that made a call, for one tool message.
The outputs are SmolLM2's own, from a run on the task, and written ones: malformed JSON, two calls, no call,
newlines inside the tag, arguments as a JSON string, text around a call, a tag left open.
"""
import datetime
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from smollm2 import calculator  # noqa: E402  (a tool of this file, as test_tools.py loads them: trl_tools.py:NAME)

OUTPUTS = [
    '<tool_call>{"name": "calculator", "arguments": {"expression": "3576850 + 57146"}}</tool_call>',
    '<tool_call>{"name": "calculator", "arguments": {"expression": "9652298 + 291211"}}</tool_call>',
    '<tool_call>{"name": "calculator", "arguments": {"expression": 14009 + 1374502}}}</tool_call>',
    '<tool_response>\n7311.02425\n</tool_response>',
    '9652298 + 291211 = 9943509',
    '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
    '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>\n'
    '<tool_call>{"name": "calculator", "arguments": {"expression": "7 * 6"}}</tool_call>',
    'Let me work it out. <tool_call>{"name": "calculator", "arguments": {"expression": "1 + 1"}}</tool_call>',
    '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2 + 2\\"}"}</tool_call>',
    '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 2"}}',
    '<tool_call>{"arguments": {"expression": "2 + 2"}}</tool_call>',
    '<tool_call>{"name": "nothing_here", "arguments": {}}</tool_call>',
]


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def main():
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import parse_response, qwen3_template

    import real_models
    import smollm2
    tokenizer = AutoTokenizer.from_pretrained(real_models.tokenizer_dir("qwen2"))
    tokenizer.chat_template = smollm2.TOOLS_TEMPLATE
    tokenizer.response_template = qwen3_template
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    prompts = [r["prompt"] for r in smollm2.calc(3, 0, tools=True)] + [[{"role": "user", "content": "What is 2+3?"}]]
    config = GRPOConfig(output_dir=os.path.join(ROOT, "runs", "trl_tools"), per_device_train_batch_size=2,
                        num_generations=2, max_completion_length=8, report_to=[], use_cpu=True)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=config,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
                          processing_class=tokenizer, tools=[calculator, add])
    prompt_ids = trainer._tokenize_prompts(prompts)[0]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    outputs = []
    for text in OUTPUTS:
        ids = tokenizer(text, add_special_tokens=False).input_ids + [end]  # a turn as sampled: it ends the turn
        parsed = parse_response(tokenizer, ids, prefix=list(prompt_ids[-1]))
        calls = [c["function"] for c in parsed.get("tool_calls") or []]
        outputs.append({"text": text, "calls": [{"name": c.get("name"), "arguments": c.get("arguments")}
                                                for c in calls]})
    suffix = trainer._get_tool_suffix_ids([{"role": "tool", "name": "calculator", "content": "3957283"}])
    out = {"recorded": f"TRL {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}, "
                       f"{datetime.date.today()}, by tests/trl_tools.py",
           "prompts": [{"messages": p, "ids": list(map(int, i))} for p, i in zip(prompts, prompt_ids)],
           "outputs": outputs, "tool_suffix": list(map(int, suffix))}
    with open(os.path.join(ROOT, "tests", "trl_tools.json"), "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(json.dumps(outputs, indent=1))


if __name__ == "__main__":
    main()
