"""What only a GPU can show, skipped without CUDA (CI never has one; tests/gpu_check.sh runs this file
on a GPU machine): the default toy run in bf16 end to end; two updates of a Qwen2-shaped random-init
model of 0.5B parameters (Qwen2.5-0.5B's shape: hidden 896, 24 layers, vocabulary 151,936) with a
random-init reward model, micro-batches and gradient checkpointing; the same checkpoints stored in bf16
training with fp32 weights and AdamW states; --offload-frozen lowering the peak allocated memory by about
the frozen models' bytes; --async-steps 1 on the toy (the weights through CUDA IPC); LoRA rank 16 with bf16
bases against full PPO on the 0.5B shape. Figures go to $GPU_CHECK_JSON when it is set.

    python tests/test_gpu.py          # only builds the 0.5B checkpoints under runs/gpu/ (bench.py uses them too)
"""
import json
import os
import shutil
import sys
import time

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import ppo  # noqa: E402
from real_models import tokenizer_dir  # noqa: E402
from test_sharded import checkpoint_contents  # noqa: E402

ROOT = os.path.join(os.path.dirname(HERE), "runs", "gpu")
QWEN2_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, max_position_embeddings=4096, vocab_size=151936, tie_word_embeddings=True)
TOPICS = ["the sea", "a lost key", "autumn", "a robot", "the moon", "a small town", "rain", "an old map"]

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tests/gpu_check.sh)")


def build():
    """runs/gpu/qwen2-0.5b/{policy,reward} (random init, the Qwen2 tokenizer) and runs/gpu/prompts.jsonl."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, Qwen2Config
    policy_dir, reward_dir = os.path.join(ROOT, "qwen2-0.5b", "policy"), os.path.join(ROOT, "qwen2-0.5b", "reward")
    prompts = os.path.join(ROOT, "prompts.jsonl")
    if not os.path.exists(os.path.join(reward_dir, "config.json")):
        tok = AutoTokenizer.from_pretrained(tokenizer_dir("qwen2"))
        torch.manual_seed(0)
        for path, cls, extra in ((policy_dir, AutoModelForCausalLM, {}),
                                 (reward_dir, AutoModelForSequenceClassification, dict(num_labels=1))):
            config = Qwen2Config(**QWEN2_05B, **extra, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
            cls.from_config(config).save_pretrained(path)
            tok.save_pretrained(path)
        with open(prompts, "w") as f:  # text prompts: TRL's baseline script applies no chat template
            f.writelines(json.dumps({"prompt": f"Write a short poem about {t}, number {i}."}) + "\n"
                         for i in range(64) for t in TOPICS)
    return policy_dir, reward_dir, prompts


def report(name, figures):
    """Print the figures and add them to $GPU_CHECK_JSON."""
    print(name, figures)
    path = os.environ.get("GPU_CHECK_JSON")
    if path:
        data = json.load(open(path)) if os.path.exists(path) else {}
        data[name] = figures
        json.dump(data, open(path, "w"), indent=1)


def run(name, **flags):
    shutil.rmtree(f"runs/{name}", ignore_errors=True)
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    ppo.main(ppo.Args(run_name=name, **dict(dict(sample_every=0, save_every=0), **flags)))
    wall = time.perf_counter() - start
    return [json.loads(line) for line in open(f"runs/{name}/metrics.jsonl")], wall


def test_default_toy_run_in_bf16(world):
    rows, wall = run("gpu_toy")  # --precision auto: bf16 on a GPU
    assert len(rows) == 100 and max(r["ppo/policy/ratio_at_start"] for r in rows) < 1e-3
    first, last = (sum(r["objective/gold"] for r in part) / 10 for part in (rows[:10], rows[-10:]))
    report("toy_bf16", dict(wall_s=round(wall, 1), gold_first10=first, gold_last10=last,
                            ratio_at_start_max=max(r["ppo/policy/ratio_at_start"] for r in rows),
                            ratio_max_at_start_max=max(r["ppo/policy/ratio_max_at_start"] for r in rows)))
    assert last > first + 0.2


def test_async_steps_on_the_gpu(world):
    """--async-steps 1 on CUDA: the sampler reads the weights through CUDA IPC; the toy still learns, and update 1
    (sampler and proximal the same weights) shows no gap but bf16's rounding."""
    rows, wall = run("gpu_toy_async", async_steps=1)
    first, last = (sum(r["objective/gold"] for r in part) / 10 for part in (rows[:10], rows[-10:]))
    report("toy_bf16_async", dict(wall_s=round(wall, 1), gold_first10=first, gold_last10=last,
                                  sampler_s=sum(r["time/sampler_s"] for r in rows),
                                  wait_s=sum(r["time/generate_s"] for r in rows)))
    assert len(rows) == 100 and last > first + 0.2 and rows[0]["rollout/logprob_diff_mean"] < 1e-2


QWEN_FLAGS = dict(batch_size=32, total_episodes=64, response_length=128, micro_batch_size=8, num_minibatches=2,
                  gradient_checkpointing=True, learning_rate=1e-6, critic_learning_rate=1e-5, eval_fraction=0.0,
                  max_prompt_length=64)


def test_half_billion_qwen2_shape():
    policy, reward, prompts = build()
    rows, wall = run("gpu_qwen2", model=policy, reward_model=reward, dataset=prompts, **QWEN_FLAGS)
    per_update = [r["time/rollout_s"] + r["time/update_s"] + r["time/log_s"] for r in rows]
    report("qwen2_0.5b", dict(updates=len(rows), s_per_update=per_update, peak_allocated_mb=rows[-1]["mem/peak_mb"],
                              ratio_at_start=[r["ppo/policy/ratio_at_start"] for r in rows],
                              generated_tokens=[r["time/generated_tokens"] for r in rows], wall_s=round(wall, 1)))
    assert len(rows) == 2 and all(r["ppo/policy/ratio_at_start"] < 1e-3 for r in rows)


def test_a_checkpoint_stored_in_bf16_trains_in_fp32():
    """Nearly every hub model is stored in bf16; transformers 5 would load it so, and AdamW on bf16 weights
    rounds most small steps away. One step at lr 1e-6 must move the fp32 weights; the final model is bf16."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    policy, reward, prompts = build()
    for src, cls in ((policy, AutoModelForCausalLM), (reward, AutoModelForSequenceClassification)):
        if not os.path.exists(os.path.join(src + "-bf16", "config.json")):
            cls.from_pretrained(src).to(torch.bfloat16).save_pretrained(src + "-bf16")
            AutoTokenizer.from_pretrained(src).save_pretrained(src + "-bf16")
    flags = dict(QWEN_FLAGS, total_episodes=32, num_minibatches=1, save_every=1)
    rows, wall = run("gpu_bf16_stored", model=policy + "-bf16", reward_model=reward + "-bf16", dataset=prompts, **flags)
    whole = checkpoint_contents("runs/gpu_bf16_stored/checkpoints/step_1")
    dtypes = sorted({str(t.dtype) for name in ("policy", "critic") for s in whole[f"{name}_adamw"]["state"].values()
                     for k, t in s.items() if k != "step"})
    start = load_file(os.path.join(policy + "-bf16", "model.safetensors"))
    stepped = whole["policy"]
    moved = sum((stepped[k] != start[k].float()).sum().item() for k in start) / sum(t.numel() for t in start.values())
    final = json.load(open("runs/gpu_bf16_stored/policy/config.json"))["dtype"]
    report("bf16_stored", dict(adamw_state_dtypes=dtypes, policy_weights_moved=moved, final_dtype=final,
                               wall_s=round(wall, 1)))
    assert dtypes == ["torch.float32"] and moved > 0.9 and final == "bfloat16"


def test_offload_frozen_lowers_peak_memory():
    from transformers import AutoModelForCausalLM
    policy, reward, prompts = build()
    flags = dict(QWEN_FLAGS, total_episodes=32, model=policy, reward_model=reward, dataset=prompts)
    kept = run("gpu_kept", **flags)[0][0]["mem/peak_mb"]
    offloaded = run("gpu_offloaded", offload_frozen=True, **flags)[0][0]["mem/peak_mb"]
    n_params = AutoModelForCausalLM.from_pretrained(policy).num_parameters()
    frozen_mb = 2 * n_params * 4 / 2**20  # the reference and the reward model (about the same size), fp32
    report("offload_frozen", dict(peak_kept_mb=kept, peak_offloaded_mb=offloaded, frozen_mb=frozen_mb))
    assert kept - offloaded > 0.5 * frozen_mb


def test_lora_with_bf16_bases_lowers_peak_memory():
    """--lora-rank 16 on the 0.5B shape, the bases in bf16 (auto on a GPU): one update against full PPO.
    No reference copy, no AdamW states but the adapters' and the value head's, half the bases' bytes."""
    policy, reward, prompts = build()
    flags = dict(QWEN_FLAGS, total_episodes=32, model=policy, reward_model=reward, dataset=prompts)
    full, full_wall = run("gpu_full", **flags)
    lora, lora_wall = run("gpu_lora", lora_rank=16, learning_rate=1e-5, **flags)
    config = json.load(open("runs/gpu_lora/config.json"))
    report("lora_r16", dict(peak_full_mb=full[0]["mem/peak_mb"], peak_lora_mb=lora[0]["mem/peak_mb"],
                            ratio=lora[0]["mem/peak_mb"] / full[0]["mem/peak_mb"], base_dtype=config["lora_base_dtype"],
                            s_per_update_full=full_wall, s_per_update_lora=lora_wall,
                            kl_update1=lora[0]["objective/kl"], ratio_at_start=lora[0]["ppo/policy/ratio_at_start"]))
    assert config["lora_base_dtype"] == "bf16" and lora[0]["objective/kl"] == 0
    assert lora[0]["ppo/policy/ratio_at_start"] < 1e-3 and lora[0]["mem/peak_mb"] < 0.6 * full[0]["mem/peak_mb"]


if __name__ == "__main__":
    print(build())
