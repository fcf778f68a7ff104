"""The chain world (chain.py) and the over-length treatments of DAPO, each against a hand-computed case."""
import json
import os
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file

import chain
import ppo
from fp32 import assert_close_fp32
from test_ppo_parts import checked, rollout_batch


@pytest.mark.fast
def test_the_chain_reward_reads_the_answer_after_the_marker():
    prompt = "1 2 3 4 9 ?"  # 19 -> 9
    assert chain.answer(prompt) == 9
    assert chain.reward([prompt] * 6, ["1 1 2 3 3 6 4 0 9 9 = 9", "= 9", "= 8", "1 1 = 9 9", "9", "= 9 ="]) == \
        [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    rng = random.Random(0)
    assert chain.correct(prompt, chain.worked(prompt, rng, slip=0.0))  # a demonstration without slips is right
    assert len(chain.worked(prompt, rng, slip=0.0).split()) == 2 * 5 + 2  # two tokens a digit, then "= a"
    slipped = [chain.correct(p, chain.worked(p, rng, slip=1.0)) for p in chain.prompts(200)]
    assert sum(slipped) < 60  # every step off by one: mostly wrong (right only when the slips cancel)


@pytest.mark.mutants  # outside the fast subset for its time; the mutation check runs it
def test_the_chain_world_is_deterministic(tmp_path):
    paths = [chain.build_world(str(tmp_path / name), seed=seed, steps=20, log=lambda *a: None)[0]
             for name, seed in (("a", 0), ("b", 0), ("c", 1))]
    weights = [load_file(os.path.join(p, "model.safetensors")) for p in paths]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])  # same seed, same world
    assert not all(torch.equal(weights[0][k], weights[2][k]) for k in weights[0])  # another seed, another one
    stamps = [json.load(open(tmp_path / name / "world.json")) for name in "ab"]
    assert stamps[0] == stamps[1]  # the measured start (accuracy, lengths) too


@pytest.mark.fast
def test_long_responses_by_hand():
    # limit 10, buffer 4: no penalty up to 6 tokens, then -0.25 a token down to -1 at 10 (the one cut there)
    scores = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0])
    lengths = torch.tensor([5, 6, 7, 9, 10])
    has_eos = torch.tensor([True, True, True, True, False])
    next_values = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.7])
    args = ppo.Args(response_length=10, max_episode_tokens=10, overlong_buffer=4, missing_eos_penalty=None)
    out, boot = ppo.long_responses(scores, has_eos, lengths, next_values, args)
    torch.testing.assert_close(out, torch.tensor([1.0, 1.0, 0.75, 0.25, 0.0]))
    assert boot is None
    args = ppo.Args(response_length=10, max_episode_tokens=10, overlong_buffer=4, missing_eos_penalty=-1.0)  # both: they add up
    out, _ = ppo.long_responses(scores, has_eos, lengths, next_values, args)
    torch.testing.assert_close(out, torch.tensor([1.0, 1.0, 0.75, 0.25, -2.0]))
    args = ppo.Args(response_length=10, max_episode_tokens=10, bootstrap_truncated=True, missing_eos_penalty=None)
    out, boot = ppo.long_responses(scores, has_eos, lengths, next_values, args)
    torch.testing.assert_close(out, torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0]))
    torch.testing.assert_close(boot, torch.tensor([0.0, 0.0, 0.0, 0.0, 0.7]))


@pytest.mark.fast
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-sum-norm"])
def test_overlong_filtering_is_training_on_the_finished_responses_alone(world, loss_agg):
    # responses 0, 3, 5, ... marked as cut by the limit: with --overlong-filter the gradient (policy and
    # critic) is the one of a minibatch of the other responses alone, normalisers included
    grads = []
    for overlong_filter, rows in ((True, torch.arange(32)), (False, None), (False, torch.arange(32))):
        policy, critic, rollout, P = rollout_batch(world)
        cut = torch.arange(32) % 3 == 0
        rollout.has_eos = ~cut  # (only the filter reads it)
        if rows is None:
            rows = torch.nonzero(rollout.has_eos).squeeze(1)
        args = checked(loss_agg=loss_agg, overlong_filter=overlong_filter, response_length=12, micro_batch_size=8)
        ppo.minibatch_backward(policy, critic, rollout, rows, P, args)
        grads.append(torch.cat([p.grad.flatten() for p in list(policy.parameters()) + list(critic.parameters())]))
    filtered, finished_only, everything = grads
    assert_close_fp32(filtered, finished_only, int(rollout.attention_mask.sum()))  # other micro-batches' sums
    assert (filtered - everything).abs().max() > 1e-4  # the cut responses did move the unfiltered gradient


@pytest.fixture(scope="module")
def small_chain(tmp_path_factory):
    """A chain world of a few pre-training steps: right some of the time, so some groups of 4 tie and some don't."""
    return chain.build_world(str(tmp_path_factory.mktemp("chain") / "chain"), steps=200, log=lambda *a: None)


@pytest.mark.mutants  # outside the fast subset for its time; the mutation check runs it
def test_a_few_updates_of_the_chain_world(small_chain, monkeypatch):
    # a small world (a few pre-training steps) stands in for the cached one; the defaults of --model chain
    # (40-token responses, the chain:reward function, the critic on the policy) are what ppo.main runs
    monkeypatch.setattr(chain, "build_world", lambda *a, **k: small_chain)
    shutil.rmtree("runs/test_chain", ignore_errors=True)
    ppo.main(ppo.Args(model="chain", run_name="test_chain", total_episodes=64, batch_size=32, num_ppo_epochs=1,
                      sample_every=1, save_every=0))
    config = json.load(open("runs/test_chain/config.json"))
    assert config["response_length"] == 40 and config["reward_fn"] == "chain:reward"
    rows = [json.loads(line) for line in open("runs/test_chain/metrics.jsonl")]
    assert len(rows) == 2 and all(0 <= r["objective/reward_fn"] <= 1 for r in rows)
    samples = [json.loads(line) for line in open("runs/test_chain/samples.jsonl")]
    assert all(s["prompt"].endswith("?") and s["score"] == chain.reward([s["prompt"]], [s["response"]])[0]
               for s in samples if s["score"] >= 0)  # (a response cut by the limit gets the missing-EOS penalty)


@pytest.mark.mutants  # outside the fast subset for its time; the mutation check runs it
def test_dynamic_sampling_trains_on_the_groups_with_a_signal_alone(small_chain, monkeypatch, tmp_path):
    """DAPO's dynamic sampling: every group trained on holds a right and a wrong answer by the task's score (a
    response cut at 12 tokens scores -1 after phase 4, a finished wrong one 0: four wrong answers stay a group
    without a signal), and no refill redraws a question of the update (40 questions, each on 20 rows)."""
    monkeypatch.setattr(chain, "build_world", lambda *a, **k: small_chain)
    drawn, trained = [], []  # each call's prompt rows; each update's batch as dynamic sampling returns it
    real_sample, real_dynamic = ppo.sample, ppo.dynamic_sampling
    monkeypatch.setattr(ppo, "sample", lambda m, a, rows, ids, idx, *r, **k: (
        drawn.append(list(idx)), real_sample(m, a, rows, ids, idx, *r, **k))[1])
    monkeypatch.setattr(ppo, "dynamic_sampling", lambda *a, **k: (
        out := real_dynamic(*a, **k), trained.append(out[0]))[0])
    questions = chain.prompts(40, seed=5)
    with open(tmp_path / "few.jsonl", "w") as f:
        f.writelines(json.dumps({"prompt": q}) + "\n" for q in questions * 20)
    shutil.rmtree("runs/test_dynamic", ignore_errors=True)
    args = ppo.Args(model="chain", run_name="test_dynamic", total_episodes=96, batch_size=32, num_ppo_epochs=1,
                    adv_estimator="grpo", group_size=4, dynamic_sampling=True, dynamic_sampling_rounds=3,
                    response_length=12, dataset=str(tmp_path / "few.jsonl"), eval_fraction=0.0, save_every=0,
                    sample_every=0)
    ppo.main(args)
    rows = [json.loads(line) for line in open("runs/test_dynamic/metrics.jsonl")]
    assert any(0 < r["sampling/dropped"] < 1 for r in rows) and any(r["sampling/rounds"] > 1 for r in rows)
    assert any(r["ppo/val/eos_rate"] < 1 for r in rows)  # some responses were cut
    prompts = [r["prompt"] for r in ppo.load_prompt_rows(args)[0]]
    for update, r in enumerate(rows, 1):
        calls, drawn = drawn[: 1 + r["sampling/rounds"]], drawn[1 + r["sampling/rounds"]:]
        # the main stream as without the flag (rows that may repeat a question); each refill of questions the
        # update has not drawn, each once
        assert calls[0] == ppo.prompt_order(update, len(prompts), args, 0, 32).tolist()
        refilled = [prompts[i] for call in calls[1:] for i in call[::4]]  # one row per group
        assert len(set(refilled)) == len(refilled) and not set(refilled) & {prompts[i] for i in calls[0]}
        batch = trained[update - 1]
        s = batch.scores.view(-1, 4)  # (groups, 4): the task's scores, before phase 4
        if r["sampling/trained_groups"] > 0:  # every group trained on has a signal; as many as logged
            assert (s != s[:, :1]).any(1).all() and len(s) == r["sampling/trained_groups"]
    assert not drawn


@pytest.mark.fast
def test_the_adaptive_kl_controller_counts_the_rows_trained_on():
    args = ppo.Args(kl_target=1.0, kl_horizon=100, batch_size=8)  # dynamic sampling kept 6 of 8 responses
    kl = torch.full((6, 2), 0.55)  # (B, T): 1.1 per response, 10% above the target
    assert ppo.adaptive_kl_coef(0.1, kl, args) == pytest.approx(0.1 * (1 + 0.1 * 6 / 100))
