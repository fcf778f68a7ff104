"""The precision table: how far each trainer precision's log-probs are from fp32's, how far the sampler's are from the
trainer's under each, and what an update costs in each.

    python smollm2.py && python experiments/precision.py      # about 25 minutes on 2 quiet CPU cores

SmolLM2-135M-Instruct (smollm2.py) on reasoning-gym's gcd prompts (temperature 0.7, up to 128 tokens), ppo.py's own
load_models / load_prompts / generate / policy_logprobs, at least 2,000 sampled tokens per measure:
  - from fp32: one set of responses sampled in fp32, scored in fp32 and under each setting (bf16 autocast; bf16 with
    the head's matmul in fp32, --fp32-head; fp16 autocast): mean and max |log-prob difference|;
  - sampler against trainer: HF sampling under the setting itself (what a run without a separate sampler does), and
    the vLLM engine in bf16 (what a GPU run with --vllm does), each scored by the trainer under the setting: mean
    |difference| and KL(sampler || trainer) (k1 on the sampled tokens);
  - seconds per update: `ppo.py` on the same task under each setting (16 rollouts of up to 128 tokens, 3 updates,
    the median of updates 2-3 of rollout plus training time), one at a time.
Writes experiments/results.json's "precision".
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
import adapters  # noqa: E402
import ppo  # noqa: E402

MIN_TOKENS, BATCH = 2000, 16
SETTINGS = {"fp32": (None, False), "bf16": (torch.bfloat16, False), "bf16, fp32 head": (torch.bfloat16, True),
            "fp16": (torch.float16, False)}  # name -> (autocast dtype, --fp32-head)
FLAGS = {"fp32": ["--precision", "fp32"], "bf16": ["--precision", "bf16"],
         "bf16, fp32 head": ["--precision", "bf16", "--fp32-head"], "fp16": ["--precision", "fp16"]}


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def autocast(dtype):
    return torch.autocast(DEVICE.type, dtype=dtype, enabled=dtype is not None)


def sample(models, prompt_ids, dtype=None, llm=None):
    """Responses to successive batches of prompts until MIN_TOKENS: (qr, am, mask, P, sampler log-probs) each."""
    batches, n, i = [], 0, 0
    while n < MIN_TOKENS:
        batch = [prompt_ids[(i + k) % len(prompt_ids)] for k in range(BATCH)]  # (a short file: round again)
        qr, am, _, _, mask, P, lp = ppo.generate(models.policy, models.tokenizer, batch,
                                                 DEVICE, llm=llm, sampler=autocast(dtype))
        batches.append((qr, am, mask, P, lp))
        n, i = n + int(mask.sum()), i + BATCH
    return batches


def score(policy, batches, dtype, tau):
    """The trainer's log-probs of each batch's tokens under the autocast `dtype`: (mask, log-probs) pairs."""
    with torch.no_grad(), autocast(dtype):
        return [(mask, ppo.policy_logprobs(policy, qr, am, P, tau, chunk=256)[0]) for qr, am, mask, P, _ in batches]


def gap(a, b, masks):
    """Mean and max |a - b| over the masked tokens of lists of (B, T) tensors, and the mean of a - b: KL(a || b) by k1
    when the tokens were sampled from a (the sampler's log-probs, or fp32's)."""
    d = torch.cat([(x - y)[m > 0] for x, y, m in zip(a, b, masks)])  # (tokens,)
    return {"mean_abs": d.abs().mean().item(), "max_abs": d.abs().max().item(), "kl": d.mean().item(),
            "tokens": len(d)}


def seconds_per_update(name, task):
    run = f"precision_{name.replace(', ', '_').replace(' ', '_')}"
    cmd = [sys.executable, "ppo.py", *task, "--batch-size", "16", "--total-episodes", "48", "--save-every", "0",
           "--sample-every", "0", "--run-name", run, *FLAGS[name]]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    rows = [json.loads(line) for line in open(os.path.join(ROOT, "runs", run, "metrics.jsonl"))]
    return statistics.median(r["time/rollout_s"] + r["time/update_s"] for r in rows[1:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="runs/smollm2/model")
    parser.add_argument("--dataset", default="reasoning-gym:gcd")
    parser.add_argument("--reward-model", default=None, help="for a --dataset without a reward of its own")
    parser.add_argument("--response-length", type=int, default=128)
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM engine's row (no vLLM here)")
    parser.add_argument("--no-speed", action="store_true", help="skip the seconds per update")
    parser.add_argument("--json", default=os.path.join(HERE, "results.json"), help="the file to add `precision` to")
    opts = parser.parse_args()
    task = ["--model", opts.model, "--dataset", opts.dataset, "--response-length", str(opts.response_length)]
    task += ["--reward-model", opts.reward_model] if opts.reward_model else []
    torch.manual_seed(0)
    args = ppo.Args(model=opts.model, dataset=opts.dataset, reward_model=opts.reward_model, precision="fp32",
                    response_length=opts.response_length, batch_size=BATCH, total_episodes=BATCH, eval_fraction=0.0)
    ppo.check_args(args, 1)
    models = ppo.load_models(args, DEVICE, print)
    models.policy.generation_config = ppo.GenerationConfig(  # as main sets it
        do_sample=True, temperature=args.temperature, top_p=1.0, top_k=0, max_new_tokens=args.response_length,
        eos_token_id=models.stop_ids, pad_token_id=models.tokenizer.pad_token_id)
    prompt_ids = ppo.load_prompts(args, models.tokenizer, print, models.env)[1]
    plain, headed = models.policy, ppo.load_models(args, DEVICE, print).policy
    headed.generation_config = plain.generation_config
    ppo.fp32_head(headed.get_output_embeddings())
    tau, rows = args.temperature, {}

    fp32_set = sample(models, prompt_ids)  # one set of responses, scored under every setting
    masks = [b[2] for b in fp32_set]
    fp32_lp = [lp for _, lp in score(plain, fp32_set, None, tau)]
    llm, vllm_set = None, None
    if not opts.no_vllm:
        args.vllm, args.sampler_precision = True, "bf16"  # the engine in bf16, as on a GPU
        llm = adapters.vllm_engine(models.policy_path, models.policy.config, args, DEVICE)
        vllm_set = sample(models, prompt_ids[len(prompt_ids) // 2:], llm=llm)
    for name, (dtype, fp32_head) in SETTINGS.items():
        models.policy = headed if fp32_head else plain
        t0 = time.time()
        row = {"from_fp32": gap(fp32_lp, [lp for _, lp in score(models.policy, fp32_set, dtype, tau)], masks)}
        own = sample(models, prompt_ids[BATCH * len(fp32_set):], dtype)  # HF sampling under the setting
        row["hf_sampler"] = gap([b[4] for b in own], [lp for _, lp in score(models.policy, own, dtype, tau)],
                                [b[2] for b in own])
        if vllm_set:
            row["vllm_bf16_sampler"] = gap([b[4] for b in vllm_set], [lp for _, lp in score(models.policy, vllm_set,
                                                                                            dtype, tau)],
                                           [b[2] for b in vllm_set])
        row["measure_s"] = round(time.time() - t0, 1)
        rows[name] = row
        print(name, json.dumps(row), flush=True)
    del llm
    for name in SETTINGS if not opts.no_speed else ():
        rows[name]["seconds_per_update"] = seconds_per_update(name, task)
        print(name, "s/update", rows[name]["seconds_per_update"], flush=True)
    results = json.load(open(opts.json)) if os.path.exists(opts.json) else {}
    results["precision"] = {"model": opts.model, "dataset": opts.dataset, "response_length": opts.response_length,
                            "device": torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu",
                            "date": time.strftime("%Y-%m-%d"), "rows": rows}
    json.dump(results, open(opts.json, "w"), indent=1)


if __name__ == "__main__":
    main()
