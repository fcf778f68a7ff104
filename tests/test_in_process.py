"""ppo.main on the toy world in this process, a few small updates each, checked against what the
algorithm implies: the temperature in every pass, the KL's sign where the reward is shaped, the health
check firing on a real fault, the critic warm-up, the penalty for a missing EOS, resume of the state the
loop changes. Fast enough to run on every change (tests/mutants.py runs them against known bugs)."""
import json
import os
import shutil

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import ppo

pytestmark = pytest.mark.fast


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


def test_first_update_at_another_temperature(world):
    # at T 1.3 every pass must take logits / 1.3: the sampler's, the old, the reference and the new
    # log-probs. Update 1 has policy = reference, so the KL is exactly 0; the ratio is 1 before the
    # first step, so with one epoch the policy loss is minus the mean whitened advantage, 0.
    row = run_main("test_hot", temperature=1.3, kl_coef=0.0, num_ppo_epochs=1)[0]
    assert row["objective/kl"] == 0.0
    assert row["ppo/policy/ratio_at_start"] < 1e-5
    assert abs(row["ppo/loss/policy_avg"]) < 1e-5  # whitening over valid tokens only: mean exactly 0
    assert abs(row["ppo/val/ratio"] - 1) < 1e-5


def test_kl_to_a_distant_reference_is_positive(world, tmp_path):
    # a reference that is a random model: KL(policy || reference) is several nats per response, and k1
    # estimates it with the policy's samples as log p - log p_ref; swapped arguments make it negative
    cfg = AutoConfig.from_pretrained(world[0])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "random_ref")
    row = run_main("test_far_ref", ref_model=str(tmp_path / "random_ref"), num_ppo_epochs=1)[0]
    assert row["objective/kl"] > 5
    assert row["objective/non_score_reward"] == pytest.approx(-0.05 * row["objective/kl"])


def test_responses_without_eos_get_the_penalty(world):
    # two tokens: no toy response ends in time ("adjective ." + EOS is the shortest)
    row = run_main("test_no_eos", response_length=2, missing_eos_penalty=-3.0, num_ppo_epochs=1)[0]
    assert row["ppo/val/eos_rate"] == 0 and row["objective/scores"] == -3.0


def test_health_check_stops_a_run_whose_passes_disagree(world, tmp_path, monkeypatch):
    # a real fault: attention dropout left on, and active in phase 7 (gradient checkpointing trains in
    # training mode), so the training pass computes another function than the rollout pass did
    path = tmp_path / "dropout_policy"
    AutoModelForCausalLM.from_pretrained(world[0], attention_dropout=0.3).save_pretrained(path)
    AutoTokenizer.from_pretrained(world[0]).save_pretrained(path)
    monkeypatch.setattr(ppo, "disable_dropout", lambda model: model.eval())
    with pytest.raises(ppo.UsageError, match="the rollout and training passes disagree"):
        run_main("test_fault", model=str(path), reward_model=world[1], gradient_checkpointing=True)


def test_critic_warmup_moves_the_critic_and_not_the_policy(world):
    rows = run_main("test_warmup", critic_warmup_updates=1, total_episodes=32, batch_size=32)  # all warm-up
    assert rows[0]["ppo/policy/approxkl_avg"] == 0  # the policy never moved within the update
    policy = AutoModelForCausalLM.from_pretrained("runs/test_warmup/policy").state_dict()
    initial = AutoModelForCausalLM.from_pretrained(world[0]).state_dict()
    assert all(torch.equal(policy[k], initial[k]) for k in initial)
    critic = AutoModelForSequenceClassification.from_pretrained("runs/test_warmup/critic").state_dict()
    start = AutoModelForSequenceClassification.from_pretrained(world[1]).state_dict()  # the critic starts as the RM
    assert any(not torch.equal(critic[k], start[k]) for k in start)


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
