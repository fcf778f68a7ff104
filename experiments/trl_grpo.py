"""The trainer people use, beside ppo.py: TRL 1.12's GRPOTrainer on the same model, prompts, reward and budget.

Runs in a virtual environment of its own (TRL's pins must not touch the project's):
    python -m venv .venv-trl && .venv-trl/bin/pip install torch==2.13.0 && .venv-trl/bin/pip install \\
        trl==1.12.0 transformers datasets accelerate requests reasoning-gym==0.1.25 tyro tqdm
    .venv-trl/bin/python experiments/trl_grpo.py --model runs/smollm2/model --dataset reasoning-gym:gcd \\
        --dataset-options '{"max_value": 20}' --answer-format number --seed 1 --out runs/exp_trl_s1

The prompts are ppo.py's own: its training rows of the task (evaluation questions taken out) in the order its
`prompt_order` draws them for the seed, read through `import ppo` (hence tyro in this environment), so that update u
of both trainers samples the same questions. The reward is ppo.py's too (`ppo.adapters.reasoning_gym_reward`), with its
missing-EOS rule: a completion that does not end in a stop token scores --missing-eos-penalty. MAPPING below is the
flag table of docs/trl.md: each TRL setting this script passes, the ppo.py flag of the GRPO arm that matches it, and
what differs where nothing matches; `tests/test_docs.py` checks that the settings passed are the ones it states.
Prints one JSON line per update (score, wall and CPU seconds, each optimizer step's seconds, peak RSS) and saves
the final policy to --out/policy.
"""
import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (TRL GRPOConfig field, its value from this script's arguments `a`, the ppo.py flag(s) of the GRPO arm, what differs)
MAPPING = [
    ("num_generations", lambda a: a.group_size, "--adv-estimator grpo --group-size G", ""),
    ("steps_per_generation", lambda a: a.num_minibatches, "--num-minibatches M", "one optimizer step per minibatch"),
    ("per_device_train_batch_size", lambda a: a.batch_size // a.num_minibatches, "--batch-size B (B / M)",
     "TRL generates B completions (B / G prompts) per update: per_device_train_batch_size x steps_per_generation"),
    ("gradient_accumulation_steps", lambda a: 1, "(micro-batches only split memory)", ""),
    ("num_iterations", lambda a: a.num_ppo_epochs, "--num-ppo-epochs K", "TRL's minibatches are slices of the batch "
     "in order (whole prompts), ppo.py's a random permutation of the rollouts, drawn anew each epoch"),
    ("max_steps", lambda a: a.updates * a.num_minibatches * a.num_ppo_epochs, "--total-episodes B x updates", ""),
    ("max_completion_length", lambda a: a.response_length if not a.tools else (a.max_tool_calls + 1) *
     a.response_length + a.max_tool_calls * 64, "--response-length", "with --tools, --max-episode-tokens' default: "
     "TRL caps the episode (tool messages in it), not each turn"),
    ("temperature", lambda a: a.temperature, "--temperature", "both take every log-prob at it"),
    ("top_p", lambda a: 1.0, "--top-p 1.0", ""), ("top_k", lambda a: 0, "--top-k 0", ""),
    ("repetition_penalty", lambda a: 1.0, "(none)", ""),
    ("learning_rate", lambda a: a.learning_rate, "--learning-rate", ""),
    ("lr_scheduler_type", lambda a: "linear", "--anneal-lr (default)", "TRL decays per optimizer step, ppo.py per "
     "update"),
    ("warmup_steps", lambda a: 0, "(none)", ""),
    ("adam_epsilon", lambda a: 1e-5, "(AdamW eps=1e-5)", ""), ("weight_decay", lambda a: 0.01, "(torch AdamW's)", ""),
    ("max_grad_norm", lambda a: 1.0, "--max-grad-norm 1.0", ""),
    ("epsilon", lambda a: a.clip_eps, "--clip-eps", ""), ("epsilon_high", lambda a: a.clip_eps, "(= --clip-eps)", ""),
    ("loss_type", lambda a: "bnpo", "--loss-agg token-mean", "bnpo divides by the minibatch's tokens, as "
     "token-mean (TRL's dapo divides by the generation batch's tokens / M)"),
    ("scale_rewards", lambda a: "group", "--group-std (default)", "std + 1e-4 in TRL, + 1e-6 in ppo.py"),
    ("beta", lambda a: a.kl_coef, "--kl-in-loss --kl-estimator k3 --kl-coef", "k3 per token in the loss on both"),
    ("mask_truncated_completions", lambda a: False, "(no --overlong-filter)", ""),
    ("disable_dropout", lambda a: True, "(always)", ""),
    ("max_tool_calling_iterations", lambda a: a.max_tool_calls, "--max-tool-calls", "TRL counts rounds of calls, "
     "ppo.py calls (with --tools: docs/tools.md)"),
    ("gradient_checkpointing", lambda a: bool(a.gradient_checkpointing), "--gradient-checkpointing (off by default)",
     "each trainer's default: on in TRL, off in ppo.py; the same numbers, less memory for more time (trlspeed "
     "measures both on both)"),
    ("optim", lambda a: "adamw_torch_fused", "(torch AdamW, foreach)", "the same update; the fused kernel makes no "
     "temporaries of the parameters' size"),
    ("shuffle_dataset", lambda a: False, "(ppo.py's rows and prompt order, through `import ppo`)", ""),
    ("seed", lambda a: a.seed, "--seed", "the prompts are the same; the random streams that sample are not"),
    ("bf16", lambda a: False, "--precision fp32 (a CPU's auto)", ""),
]


def grpo_config_kwargs(a):
    """GRPOConfig's settings for this run, as MAPPING states them."""
    return {name: value(a) for name, value, _, _ in MAPPING}


def ppo_flags(a):
    """ppo.py's GRPO arm at the same settings (the flags MAPPING names)."""
    data = ["--dataset", a.dataset, "--eval-size", str(a.eval_size), "--max-prompt-length", str(a.max_prompt_length)]
    data += ["--dataset-options", a.dataset_options] if a.dataset_options else []
    data += ["--reward-fn", a.reward_fn] if a.reward_fn else ["--answer-format", a.answer_format]
    data += ["--tools", a.tools, "--max-tool-calls", str(a.max_tool_calls)] if a.tools else []
    return [*data, "--adv-estimator", "grpo", "--group-size", str(a.group_size), "--batch-size", str(a.batch_size),
            "--num-minibatches", str(a.num_minibatches), "--num-ppo-epochs", str(a.num_ppo_epochs),
            "--total-episodes", str(a.batch_size * a.updates), "--response-length", str(a.response_length),
            "--temperature", str(a.temperature), "--learning-rate", str(a.learning_rate),
            "--clip-eps", str(a.clip_eps), "--loss-agg", "token-mean", "--kl-in-loss", "--kl-estimator", "k3",
            "--kl-coef", str(a.kl_coef), "--missing-eos-penalty", str(a.missing_eos_penalty), "--seed", str(a.seed),
            "--precision", "fp32"]


def parser():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="an HF checkpoint folder (a model built in memory has no path)")
    ap.add_argument("--dataset", required=True, help="reasoning-gym:NAME or a prompt file, as ppo.py's --dataset")
    ap.add_argument("--reward-fn", default=None, help="FILE.py:NAME, as ppo.py's (a prompt file's score)")
    ap.add_argument("--tools", default=None, help="FILE.py:NAME[,NAME...], as ppo.py's: GRPOTrainer's tools=")
    ap.add_argument("--max-tool-calls", type=int, default=8, help="as ppo.py's: max_tool_calling_iterations")
    ap.add_argument("--max-prompt-length", type=int, default=512, help="as ppo.py's (TRL renders prompts whole)")
    ap.add_argument("--dataset-options", default=None, help="as ppo.py's")
    ap.add_argument("--answer-format", default="tag", help="as ppo.py's")
    ap.add_argument("--eval-size", type=int, default=256, help="as ppo.py's: the evaluation questions leave training")
    ap.add_argument("--out", required=True, help="the run's folder: metrics.jsonl, policy/")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--num-minibatches", type=int, default=2)
    ap.add_argument("--num-ppo-epochs", type=int, default=1)
    ap.add_argument("--updates", type=int, default=25)
    ap.add_argument("--response-length", type=int, default=24)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--learning-rate", type=float, default=2e-5)
    ap.add_argument("--clip-eps", type=float, default=0.2)
    ap.add_argument("--kl-coef", type=float, default=0.04)
    ap.add_argument("--missing-eos-penalty", type=float, default=-1.0)
    ap.add_argument("--gradient-checkpointing", type=int, default=1, help="1: TRL's default (recompute activations)")
    return ap


def training_prompts(a, ppo):
    """ppo.py's training rows for these flags, one per prompt in the order its updates draw them (each update's
    B / G prompts; ppo.py samples each G times side by side, as TRL's num_generations does)."""
    import tyro
    args = tyro.cli(ppo.Args, args=["--model", a.model, *ppo_flags(a)])
    args.fill_defaults(1)
    rows = ppo.load_prompt_rows(args, None, print)[0]
    order = [ppo.prompt_order(u, len(rows), args, 0, a.batch_size)[:: a.group_size] for u in range(1, a.updates + 1)]
    return [rows[i] for update in order for i in update]


def peak_rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024


def main():
    a = parser().parse_args()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    sys.path.insert(0, ROOT)
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    import ppo  # its reasoning-gym reward, the one ppo.py trains on

    tokenizer = AutoTokenizer.from_pretrained(a.model, padding_side="left")
    stop_ids = {tokenizer.eos_token_id, tokenizer.pad_token_id}  # TRL ends a completion at the EOS (or pads)
    rows = training_prompts(a, ppo)
    tools = []
    if a.tools:  # (TRL parses calls with a response template; for the Hermes form of a template it does not know,
        import tools as tools_py  # Qwen 3's, which reads that form, as tests/trl_tools.py does)
        from trl.chat_template_utils import qwen3_template
        tools, tokenizer.response_template = tools_py.load(a.tools), qwen3_template
    if a.reward_fn:  # a prompt file: its columns go to the reward function, as ppo.py's --reward-fn
        score_fn = ppo.load_python(a.reward_fn, "--reward-fn")
        data = Dataset.from_list([{k: json.dumps(v) if k != "prompt" else v for k, v in r.items()} for r in rows])
    else:
        data = Dataset.from_list([{"prompt": r["prompt"], "entry": json.dumps(r["entry"]), "task": r["task"],
                                   "answer_format": r["answer_format"]} for r in rows])

    def reward(prompts, completions, completion_ids, **columns):  # (with tools: the last message, the answer)
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        if a.reward_fn:
            scores = score_fn(prompts, texts, **{k: [json.loads(v) for v in vs] for k, vs in columns.items()
                                                 if k in rows[0] and k != "prompt"})
        else:
            scores = ppo.adapters.reasoning_gym_reward(prompts, texts, columns["task"],
                                                       [json.loads(e) for e in columns["entry"]],
                                                       columns["answer_format"])
        return [s if ids and ids[-1] in stop_ids else a.missing_eos_penalty for s, ids in zip(scores, completion_ids)]

    steps_per_update = a.num_minibatches * a.num_ppo_epochs

    class Log(TrainerCallback):  # one row per update (steps_per_update optimizer steps): its score, seconds, memory
        def __init__(self):
            self.t, self.cpu, self.rewards, self.steps = time.perf_counter(), time.process_time(), [], []
            self.file = open(os.path.join(a.out, "metrics.jsonl"), "a")

        def on_step_begin(self, args, state, control, **kw):
            self.step_t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):  # the update's first step generates and scores too
            self.steps.append(time.perf_counter() - self.step_t)

        def on_log(self, args, state, control, logs=None, **kw):  # (after each step: its slice's mean reward)
            if logs and "reward" in logs:
                self.rewards.append(float(logs["reward"]))
            if state.global_step % steps_per_update == 0 and self.rewards:  # (TRL logs it once per generation)
                now = time.perf_counter()
                row = {"step": state.global_step // steps_per_update, "score": sum(self.rewards) / len(self.rewards),
                       "update_s": now - self.t, "cpu_s": time.process_time() - self.cpu, "step_s": self.steps,
                       "peak_rss_mb": peak_rss_mb()}
                self.t, self.cpu, self.rewards, self.steps = now, time.process_time(), [], []
                self.file.write(json.dumps(row) + "\n")
                self.file.flush()
                print(json.dumps(row), flush=True)

    os.makedirs(a.out, exist_ok=True)
    torch.manual_seed(a.seed)
    config = GRPOConfig(output_dir=os.path.join(a.out, "trl"), report_to="none", save_strategy="no", logging_steps=1,
                        disable_tqdm=True, use_cpu=not torch.cuda.is_available(), **grpo_config_kwargs(a))
    trainer = GRPOTrainer(model=a.model, reward_funcs=reward, args=config, train_dataset=data,
                          processing_class=tokenizer, callbacks=[Log()], tools=tools or None)
    trainer.train()
    trainer.save_model(os.path.join(a.out, "policy"))
    tokenizer.save_pretrained(os.path.join(a.out, "policy"))


if __name__ == "__main__":
    main()
