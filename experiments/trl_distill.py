"""TRL 1.12's DistillationTrainer beside ppo.py's `--distill loss` (issue 63, docs/distill.md): the same student,
teacher, prompts, completions an update, response length, temperature, learning rate, precision and divergence.

Runs in TRL's own environment, as experiments/trl_grpo.py does (its setup, then):
    .venv-trl/bin/python experiments/trl_distill.py --model runs/smollm2/model \\
        --teacher runs/exp_distill_rl_s1/policy --dataset reasoning-gym:gcd --dataset-options '{"max_value": 20}' \\
        --answer-format number --eval-size 32 --seed 1 --updates 3 --out runs/exp_trl_distill_s1

An update is one optimizer step on --batch-size completions generated together (TRL's generation batch:
per_device_train_batch_size x gradient_accumulation_steps, one completion a prompt). The prompts are ppo.py's own
training rows in its order (trl_grpo.training_prompts at one sample a prompt). `ppo_flags` gives ppo.py's arm at the
same settings: its GRPO groups of 4 over zero task scores (advantages 0), one minibatch, one epoch, so the loss is the
divergence alone and no pass runs in phase 3. Prints one JSON line per update (wall and CPU seconds, peak RSS).
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trl_grpo  # noqa: E402  (its parser, prompts and RSS reader)


def parser():
    ap = trl_grpo.parser()
    ap.add_argument("--teacher", required=True, help="the teacher's HF checkpoint folder (the student's tokenizer)")
    ap.add_argument("--beta", type=float, default=1.0, help="the generalized JSD's beta (TRL's default 1: reverse KL)")
    return ap


def ppo_flags(a):
    """ppo.py's --distill loss arm at the same settings."""
    data = ["--dataset", a.dataset, "--answer-format", a.answer_format, "--eval-size", str(a.eval_size)]
    data += ["--dataset-options", a.dataset_options] if a.dataset_options else []
    return [*data, "--teacher", a.teacher, "--distill", "loss", "--distill-beta", str(a.beta), "--kl-coef", "0",
            "--reward-fn", "experiments/run.py:held_out_score", "--adv-estimator", "grpo", "--group-size", "4",
            "--batch-size", str(a.batch_size), "--num-minibatches", "1", "--num-ppo-epochs", "1",
            "--micro-batch-size", str(a.batch_size // 2), "--total-episodes", str(a.batch_size * a.updates),
            "--response-length", str(a.response_length), "--temperature", str(a.temperature), "--learning-rate",
            str(a.learning_rate), "--seed", str(a.seed), "--precision", "fp32",
            *(["--gradient-checkpointing"] if a.gradient_checkpointing else [])]


def main():
    a = parser().parse_args()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    sys.path.insert(0, trl_grpo.ROOT)
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import DistillationConfig, DistillationTrainer
    import ppo

    tokenizer = AutoTokenizer.from_pretrained(a.model, padding_side="left")
    one_each = parser().parse_args([*sys.argv[1:], "--group-size", "1"])  # one completion a prompt, as TRL samples
    data = Dataset.from_list([{"prompt": r["prompt"]} for r in trl_grpo.training_prompts(one_each, ppo)])

    class Log(TrainerCallback):  # one row per update (one optimizer step): its seconds and memory
        def __init__(self):
            self.t, self.cpu = time.perf_counter(), time.process_time()
            self.file = open(os.path.join(a.out, "metrics.jsonl"), "a")

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            row = {"step": state.global_step, "update_s": now - self.t, "cpu_s": time.process_time() - self.cpu,
                   "peak_rss_mb": trl_grpo.peak_rss_mb()}
            self.t, self.cpu = now, time.process_time()
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
            print(json.dumps(row), flush=True)

    os.makedirs(a.out, exist_ok=True)
    torch.manual_seed(a.seed)
    config = DistillationConfig(
        output_dir=os.path.join(a.out, "trl"), report_to="none", save_strategy="no", logging_steps=1,
        disable_tqdm=True, use_cpu=not torch.cuda.is_available(), per_device_train_batch_size=a.batch_size // 2,
        gradient_accumulation_steps=2, max_steps=a.updates, max_completion_length=a.response_length,
        temperature=a.temperature, top_p=1.0, top_k=0, learning_rate=a.learning_rate, lr_scheduler_type="linear",
        warmup_steps=0, adam_epsilon=1e-5, weight_decay=0.01, max_grad_norm=1.0, beta=a.beta,
        shuffle_dataset=False, seed=a.seed, bf16=False, gradient_checkpointing=bool(a.gradient_checkpointing),
        disable_dropout=True)
    trainer = DistillationTrainer(model=a.model, teacher_model=a.teacher, args=config, train_dataset=data,
                                  processing_class=tokenizer, callbacks=[Log()])
    trainer.train()
    trainer.save_model(os.path.join(a.out, "policy"))
    tokenizer.save_pretrained(os.path.join(a.out, "policy"))


if __name__ == "__main__":
    main()
