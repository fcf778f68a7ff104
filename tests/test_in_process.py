"""ppo.main on the toy world in this process, a few small updates each, checked against what the
algorithm implies: the temperature in every pass, the KL's sign where the reward is shaped, the health
check firing on a real fault, the critic warm-up, the penalty for a missing EOS, resume of the state the
loop changes. Fast enough to run on every change (tests/mutants.py runs them against known bugs)."""
import json
import math
import os
import shutil

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import ppo
from fp32 import logprob_tolerance


def rows_of(name):
    return [json.loads(line) for line in open(f"runs/{name}/metrics.jsonl")]


def run_main(name, **flags):
    """A fresh in-process run; its metrics rows."""
    shutil.rmtree(f"runs/{name}", ignore_errors=True)
    flags = dict(dict(total_episodes=64, batch_size=64, sample_every=0, save_every=0), **flags)
    ppo.main(ppo.Args(run_name=name, **flags))
    return rows_of(name)


def without_timings(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "mem/"))} for r in rows]


@pytest.mark.fast
def test_first_update_at_another_temperature(world):
    # at T 1.3 every pass must take logits / 1.3: the sampler's, the old, the reference and the new
    # log-probs. Update 1 has policy = reference, so the KL is exactly 0; the ratio is 1 before the
    # first step, so with one epoch the policy loss is minus the mean whitened advantage, 0.
    row = run_main("test_hot", temperature=1.3, kl_coef=0.0, num_ppo_epochs=1, old_logprobs="recompute",
                   unread_reference=True)[0]  # (the textbook's passes, all of them: beta 0 would skip two)
    assert row["objective/kl"] == 0.0
    assert row["ppo/policy/ratio_at_start"] < 1e-5
    assert abs(row["ppo/loss/policy_avg"]) < 1e-5  # whitening over valid tokens only: mean exactly 0
    assert abs(row["ppo/val/ratio"] - 1) < 1e-5


@pytest.mark.fast
def test_kl_to_a_distant_reference_is_positive(world, tmp_path):
    # a reference that is a random model: KL(policy || reference) is several nats per response, and k1
    # estimates it with the policy's samples as log p - log p_ref; swapped arguments make it negative
    cfg = AutoConfig.from_pretrained(world[0])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "random_ref")
    row = run_main("test_far_ref", ref_model=str(tmp_path / "random_ref"), num_ppo_epochs=1)[0]
    assert row["objective/kl"] > 5
    assert row["objective/non_score_reward"] == pytest.approx(-0.05 * row["objective/kl"])


@pytest.mark.fast
def test_responses_without_eos_get_the_penalty(world):
    # two tokens: no toy response ends in time ("adjective ." + EOS is the shortest)
    row = run_main("test_no_eos", response_length=2, missing_eos_penalty=-3.0, num_ppo_epochs=1)[0]
    assert row["ppo/val/eos_rate"] == 0 and row["objective/scores"] == -3.0


MICRO = dict(micro_batch_size=8, num_minibatches=2)  # the setting where bf16 rounds the two passes apart


@pytest.mark.mutants  # outside the fast subset for its time; the mutation check runs it
def test_bf16_passes_its_own_health_check(world, monkeypatch):
    # bf16 autocast on a CPU rounds like a GPU's: the rollout and training passes see micro-batches of other
    # rows and lengths, so single tokens may differ by a few percent; the mean over the minibatch stays within the
    # check's default tolerance. How far within, and whether a token differs at all, is the CPU's bf16 kernels'
    # (AMX, AVX-512 BF16 and AVX2 round other partial sums): that bf16 was on is read from the autocast itself
    autocast, logprobs = [], ppo.policy_logprobs

    def seen(*a, **k):
        if torch.is_grad_enabled():  # the training forwards (the no-grad ones include the chunked head's probe)
            autocast.append(torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16)
        return logprobs(*a, **k)
    monkeypatch.setattr(ppo, "policy_logprobs", seen)
    rows = run_main("test_bf16", precision="bf16", total_episodes=20 * 32, batch_size=32, **MICRO)
    assert len(rows) == 20 and len(autocast) >= 20 and all(autocast)
    assert max(r["ppo/policy/ratio_at_start"] for r in rows) < 1e-2  # the default tolerance of a recomputed pass
    assert rows[-1]["objective/gold"] > rows[0]["objective/gold"]


def gpt2_policy(world, path):
    """A random-init GPT-2 on the toy tokenizer: learned absolute positions, where position ids matter."""
    from transformers import GPT2Config
    tok = AutoTokenizer.from_pretrained(world[0])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(GPT2Config(
        vocab_size=len(tok), n_positions=128, n_embd=64, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)).save_pretrained(path)
    tok.save_pretrained(path)
    return dict(model=str(path), reward_model=world[1])


@pytest.mark.fast
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("fault", ["dropout", "temperature", "position_ids"])
def test_health_check_stops_a_run_whose_passes_disagree(world, tmp_path, monkeypatch, fault, precision):
    flags = dict(MICRO, precision=precision)
    if fault == "dropout":  # attention dropout left on, active in phase 7 (gradient checkpointing trains in
        # training mode): the training pass computes another function than the rollout pass did
        path = tmp_path / "dropout_policy"
        AutoModelForCausalLM.from_pretrained(world[0], attention_dropout=0.3).save_pretrained(path)
        AutoTokenizer.from_pretrained(world[0]).save_pretrained(path)
        monkeypatch.setattr(ppo, "disable_dropout", lambda model: model.eval())
        flags.update(model=str(path), reward_model=world[1], gradient_checkpointing=True)
    elif fault == "temperature":  # the training pass forgets --temperature (takes the raw logits)
        logprobs = ppo.policy_logprobs
        monkeypatch.setattr(ppo, "policy_logprobs", lambda model, qr, am, P, temperature, *a, **k: logprobs(
            model, qr, am, P, 1.0 if torch.is_grad_enabled() else temperature, *a, **k))
    else:  # the training pass counts positions from the padding (0, 1, 2...) on a model with learned positions
        forward = ppo.forward

        def positions_from_padding(model, qr, am, **kw):
            if not torch.is_grad_enabled():
                return forward(model, qr, am, **kw)
            positions = torch.arange(qr.shape[1]).expand_as(qr)  # (b, P+T): ignores the left padding
            return model(input_ids=qr, attention_mask=am, position_ids=positions, use_cache=False, **kw)
        monkeypatch.setattr(ppo, "forward", positions_from_padding)
        flags.update(gpt2_policy(world, tmp_path / "gpt2"))
    steps = []  # the check runs before the first optimizer step: a broken update is never applied
    monkeypatch.setattr(ppo, "optimizer_step", lambda *a: steps.append(1))
    with pytest.raises(ppo.UsageError, match="update 1: mean .* the rollout and training passes disagree"):
        run_main(f"test_fault_{fault}_{precision}", **flags)
    assert steps == []


@pytest.mark.fast
def test_a_non_finite_ratio_stops_the_run_before_any_step(world, monkeypatch):
    # NaN > tol is False: a NaN old log-prob on a real token must still stop the run, with its own message,
    # before the first step
    rollout_passes, steps = ppo.rollout_passes, []

    def poisoned(*a, **k):
        logprobs, *rest = rollout_passes(*a, **k)
        logprobs[0, 0] = math.nan
        return logprobs, *rest
    monkeypatch.setattr(ppo, "rollout_passes", poisoned)
    monkeypatch.setattr(ppo, "optimizer_step", lambda *a: steps.append(1))
    with pytest.raises(ppo.UsageError, match="update 1: the importance ratio is not finite before any step"):
        run_main("test_nan_ratio", total_episodes=32, batch_size=32)
    assert steps == []


@pytest.mark.fast
def test_a_non_finite_log_prob_on_padding_reaches_nothing(world, monkeypatch):
    # padding is never trained on: a NaN the training pass computes there (0 x NaN = NaN) must reach neither
    # the ratio's statistics nor the loss
    policy_logprobs = ppo.policy_logprobs

    def nan_on_padding(model, qr, am, P, *a, **k):
        logprobs, *rest = policy_logprobs(model, qr, am, P, *a, **k)
        if torch.is_grad_enabled():
            logprobs = torch.where(am[:, P:].bool(), logprobs, math.nan)  # (b, t)
        return logprobs, *rest
    monkeypatch.setattr(ppo, "policy_logprobs", nan_on_padding)
    row = run_main("test_nan_on_padding", total_episodes=32, batch_size=32, **MICRO)[0]
    assert row["ppo/policy/ratio_at_start"] < 1e-5 and row["ppo/skipped_steps"] == 0
    assert math.isfinite(row["ppo/loss/policy_avg"]) and math.isfinite(row["ppo/policy/approxkl_avg"])


@pytest.mark.fast
def test_critic_warmup_moves_the_critic_and_not_the_policy(world):
    rows = run_main("test_warmup", critic_warmup_updates=1, total_episodes=32, batch_size=32)  # all warm-up
    # the policy never moved within the update: 1/2 (log ratio)^2 of two passes that differ only in fp32's rounding
    assert rows[0]["ppo/policy/approxkl_avg"] <= logprob_tolerance(world[0]) ** 2 / 2
    policy = AutoModelForCausalLM.from_pretrained("runs/test_warmup/policy").state_dict()
    initial = AutoModelForCausalLM.from_pretrained(world[0]).state_dict()
    assert all(torch.equal(policy[k], initial[k]) for k in initial)
    critic = AutoModelForSequenceClassification.from_pretrained("runs/test_warmup/critic").state_dict()
    start = AutoModelForSequenceClassification.from_pretrained(world[1]).state_dict()  # the critic starts as the RM
    assert any(not torch.equal(critic[k], start[k]) for k in start)


@pytest.mark.fast
def test_resume_restores_the_kl_coefficient_and_the_best_metric(world):
    # adaptive KL far below its target: beta shrinks by the clipped step every update, so keeping the
    # best of `objective/kl_coef` keeps update 1's models and no later update beats it
    flags = dict(total_episodes=4 * 32, batch_size=32, kl_target=100.0, keep_best="objective/kl_coef", save_every=2)
    straight = run_main("test_resume_straight", **flags)
    assert straight[0]["objective/kl_coef"] == pytest.approx(0.05 * (1 - 0.2 * 32 / 10000), abs=1e-12)
    assert [r["objective/kl_coef"] for r in straight] == sorted((r["objective/kl_coef"] for r in straight),
                                                               reverse=True)
    assert os.path.exists("runs/test_resume_straight/best/policy")
    resumed = run_main("test_resume_branch", resume="runs/test_resume_straight/checkpoints/step_2", **flags)
    assert without_timings(resumed) == without_timings(straight[2:])  # kl_coef restored: the same updates 3, 4
    assert not os.path.exists("runs/test_resume_branch/best")  # best restored: nothing beat update 1
