"""One flag per idea: each variant changes what it should, and the default leaves the reference behaviour."""
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import ppo
from gae import compute_gae
from test_ppo_parts import checked, rollout_batch


@pytest.mark.fast
def test_k2_and_abs_estimators():
    logp, ref = torch.log(torch.tensor([0.5, 0.25])), torch.log(torch.tensor([0.25, 0.5]))
    torch.testing.assert_close(ppo.kl_penalty(logp, ref, "k2"), torch.full((2,), 0.5 * math.log(2) ** 2))
    torch.testing.assert_close(ppo.kl_penalty(logp, ref, "abs"), torch.full((2,), math.log(2)))


@pytest.mark.fast
def test_asymmetric_clip_moves_only_the_upper_bound():
    old, adv = torch.zeros(1, 2), torch.tensor([[1.0, -1.0]])
    new = torch.log(torch.tensor([[1.25, 0.75]]))  # above 1 + 0.2 for A > 0, below 1 - 0.2 for A < 0
    _, _, _, symmetric = ppo.policy_loss(new, old, adv, 0.2)
    _, _, _, higher = ppo.policy_loss(new, old, adv, 0.2, clip_eps_high=0.28)
    assert symmetric.tolist() == [[1.0, 1.0]] and higher.tolist() == [[0.0, 1.0]]


@pytest.mark.fast
def test_dual_clip_caps_the_loss_of_negative_advantages_only():
    old = torch.zeros(1, 2)
    new = torch.log(torch.tensor([[5.0, 5.0]])).requires_grad_()  # a ratio of 5
    adv = torch.tensor([[-1.0, 1.0]])
    plain, *_ = ppo.policy_loss(new, old, adv, 0.2)
    dual, *_ = ppo.policy_loss(new, old, adv, 0.2, dual_clip=3.0)
    assert plain[0, 0].item() == pytest.approx(5.0) and dual[0, 0].item() == pytest.approx(3.0)  # -A r = 5, capped at -c A = 3
    assert dual[0, 1] == plain[0, 1]  # A > 0: untouched
    dual.sum().backward()
    assert new.grad[0, 0] == 0  # the capped token no longer pushes


@pytest.mark.fast
def test_the_dual_clip_on_an_exact_tie_takes_verls_and_areals_gradient():
    """Issue 62: where -A r equals the cap -c A exactly, the loss is veRL's and AReaL's torch.min(-c A, loss), whose
    gradient a tie splits in two; the token's gradient is theirs, not twice it."""
    old, adv = torch.zeros(1, 1), torch.tensor([[-1.0]])
    new = torch.log(torch.tensor([[3.0]])).requires_grad_()
    c = torch.exp(new - old).item()  # the cap at the ratio itself, as fp32 computes it: an exact tie
    ppo.policy_loss(new, old, adv, 0.2, dual_clip=c)[0].sum().backward()
    theirs = new.detach().clone().requires_grad_()  # veRL 0.9.1's compute_policy_loss, written out
    r = torch.exp(theirs - old)
    clip1 = torch.max(-adv * r, -adv * torch.clamp(r, 0.8, 1.2))
    torch.where(adv < 0, torch.min(-adv * c, clip1), clip1).sum().backward()
    assert new.grad.item() == theirs.grad.item() == pytest.approx(1.5)  # d(-A r)/d log r = 3, halved by the tie


@pytest.mark.fast
def test_loss_weights():
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 0, 0, 0]])
    lengths = torch.tensor([4, 1])
    token = ppo.loss_weights(mask, lengths, mask.sum(), 2.0, "token-mean", 8)
    seq = ppo.loss_weights(mask, lengths, mask.sum(), 2.0, "seq-mean-token-mean", 8)
    norm = ppo.loss_weights(mask, lengths, mask.sum(), 2.0, "seq-sum-norm", 8)
    torch.testing.assert_close(token.sum(1), torch.tensor([0.8, 0.2]))  # long responses weigh more
    torch.testing.assert_close(seq.sum(1), torch.tensor([0.5, 0.5]))  # each response the same
    torch.testing.assert_close(norm[mask.bool()], torch.full((5,), 1 / 16))  # each token the same, constant divisor
    assert (token[~mask.bool()] == 0).all() and (seq[~mask.bool()] == 0).all() and (norm[~mask.bool()] == 0).all()


@pytest.mark.fast
def test_group_advantages():
    r = torch.tensor([1.0, 3.0, 0.0, 0.0, 2.0, 4.0])  # three groups of two
    torch.testing.assert_close(ppo.group_advantages(r, 2, "grpo", divide_by_std=False), torch.tensor([-1.0, 1, 0, 0, -1, 1]))
    torch.testing.assert_close(ppo.group_advantages(r, 2, "rloo"), torch.tensor([-2.0, 2, 0, 0, -2, 2]))
    g = ppo.group_advantages(torch.tensor([1.0, 2.0, 3.0]), 3, "grpo")
    torch.testing.assert_close(g, torch.tensor([-1.0, 0.0, 1.0]), atol=1e-5, rtol=0)  # over the std (1)


@pytest.mark.fast
def test_per_row_lambda_equals_row_by_row_gae():
    g = torch.Generator().manual_seed(2)
    r, v = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    mask = (torch.arange(5) < torch.tensor([[5], [3], [1]])).float()
    lam = torch.tensor([0.9, 0.5, 0.0])
    adv, _ = compute_gae(r, v, mask, 1.0, lam)
    for i in range(3):
        torch.testing.assert_close(adv[i], compute_gae(r[i:i + 1], v[i:i + 1], mask[i:i + 1], 1.0, float(lam[i]))[0][0])


def grads(world, **flags):
    policy, critic, rollout, P = rollout_batch(world, B=16)
    vars(rollout).update(ref_logprobs=rollout.logprobs - 0.3 * rollout.mask, kl_coef=flags.pop("kl_coef", 0.0))
    ppo.minibatch_backward(policy, critic, rollout, torch.arange(16), P, checked(**flags))
    return torch.cat([p.grad.flatten() for p in policy.parameters()])


@pytest.mark.fast
def test_kl_in_loss_adds_its_gradient_and_nothing_else(world):
    base = grads(world)
    torch.testing.assert_close(grads(world, kl_in_loss=True, kl_coef=0.0), base)  # beta 0: the same update
    assert (grads(world, kl_in_loss=True, kl_coef=0.5) - base).abs().max() > 1e-4


def run(name, *flags):
    shutil.rmtree(f"runs/{name}", ignore_errors=True)
    out = subprocess.run([sys.executable, "ppo.py", "--run-name", name, "--total-episodes", "192", *flags],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in open(f"runs/{name}/metrics.jsonl")]


def test_target_kl_stops_the_epochs(world):
    rows = run("test_target_kl", "--target-kl", "1e-12", "--num-minibatches", "2")
    assert all(r["ppo/epochs"] == 1 for r in rows[1:])  # stopped after the first epoch (update 1 is on-policy)
    assert all(r["objective/kl_k1"] == pytest.approx(r["objective/kl"], abs=1e-7) for r in rows)  # k1: the same


def test_critic_free_estimators_load_no_critic(world):
    for estimator in ("grpo", "rloo"):
        rows = run(f"test_{estimator}", "--adv-estimator", estimator, "--group-size", "4", "--kl-in-loss",
                   "--kl-estimator", "k3", "--loss-agg", "seq-sum-norm", "--clip-eps-high", "0.28", "--dual-clip", "3")
        assert not os.path.exists(f"runs/test_{estimator}/critic")
        assert all(r["ppo/loss/value_avg"] == 0 and r["objective/non_score_reward"] == 0 for r in rows)
        assert all(r["objective/kl_k1"] != r["objective/kl"] for r in rows[1:])  # k3's estimate is not k1's


def test_ptx_and_vapo_options_change_the_update(world):
    base = run("test_base", "--total-episodes", "64")
    for name, flags in (("test_ptx", ["--ptx-coef", "0.5"]),
                        ("test_vapo", ["--critic-lam", "1.0", "--lam-alpha", "0.05", "--loss-agg", "seq-mean-token-mean",
                                       "--critic-init", "scratch"])):
        rows = run(name, "--total-episodes", "64", *flags)
        assert rows[0]["objective/scores"] == base[0]["objective/scores"]  # the same rollout...
        a = AutoModelForCausalLM.from_pretrained(f"runs/{name}/policy").lm_head.weight
        b = AutoModelForCausalLM.from_pretrained("runs/test_base/policy").lm_head.weight
        assert not torch.equal(a, b)  # ...and a different update


@pytest.mark.fast
def test_sampling_support_keeps_what_hf_keeps():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 4, 50, generator=g) * 2
    assert (ppo.sampling_support(logits, 5, 1.0).sum(-1) == 5).all()
    support = ppo.sampling_support(logits, 0, 0.8)
    p = torch.softmax(logits, -1)
    kept = (p * support).sum(-1)
    smallest = p.masked_fill(~support, 2.0).min(-1).values
    assert (kept >= 0.8 - 1e-6).all() and (kept - smallest < 0.8).all()  # the smallest set that reaches 0.8
    logp, ent = ppo.logprobs_from_logits(logits, logits.argmax(-1), 1.0, True, support)
    assert torch.isfinite(ent).all() and (logp > torch.log_softmax(logits, -1).max(-1).values - 1e-6).all()


def test_keep_sampling_mask_makes_top_p_and_top_k_trainable(world):
    rows = run("test_keep_mask", "--top-p", "0.8", "--top-k", "10", "--keep-sampling-mask")
    assert all(r["ppo/policy/ratio_at_start"] < 1e-5 for r in rows)  # old and new on the same truncated support
    assert all(math.isfinite(r["objective/entropy"]) and math.isfinite(r["ppo/loss/policy_avg"]) for r in rows)


VERL = json.load(open(os.path.join(os.path.dirname(__file__), "verl_objectives.json")))  # tests/verl_oracle.py
MODES = {"token-mean": "token-mean", "seq-mean-token-mean": "seq-mean-token-mean",
         "seq-mean-token-sum-norm": "seq-sum-norm"}  # veRL's names -> ppo.py's


@pytest.mark.fast
@pytest.mark.parametrize("case", VERL["cases"], ids=lambda c: f"{c['objective']}-{c['mode']}-is{c['rollout_is_weights']:d}")
def test_each_objective_equals_verl_in_value_and_gradient(case):
    """ppo.py's objectives against veRL 0.9.1's own (recorded by tests/verl_oracle.py; veRL is not installed
    here) on ragged rows: right padding, an episode's hole, an empty row. The loss as minibatch_backward sums
    it (padding's new log-prob set to the old, weights of --loss-agg), in fp32 as ppo.py runs it."""
    inputs, name = VERL["inputs"], case["objective"]
    mask = torch.tensor(inputs["response_mask"], dtype=torch.float32)  # (B, T)
    old = torch.tensor(inputs["old_log_prob"], dtype=torch.float32)  # (B, T)
    new = torch.tensor(inputs["log_prob"][name], dtype=torch.float32).requires_grad_()  # (B, T)
    adv = torch.tensor(inputs["advantages"], dtype=torch.float32)  # (B, T)
    clip = case["clip"]
    args = ppo.Args(policy_loss="ppo" if name == "vanilla" else name, loss_agg=MODES[case["mode"]],
                    clip_eps=clip["clip_ratio_low"], clip_eps_high=clip["clip_ratio_high"],
                    dual_clip=clip.get("clip_ratio_c"), cispo_cap=1 + clip["clip_ratio_high"])
    if name == "cispo":  # veRL's lower bound 1 - 1.0 = 0: none, as ppo.py's
        assert clip["clip_ratio_low"] == 1.0
        args.clip_eps = args.clip_eps_high = None
    ppo.check_args(args, 1)
    losses, _, _, clipped = ppo.policy_objective(torch.where(mask.bool(), new, old), old, adv, mask, args)
    weights = ppo.loss_weights(mask, mask.sum(1), mask.sum(), (mask.amax(1) > 0).sum(), args.loss_agg,
                               VERL["T"])  # (B, T): seq-sum-norm's constant divisor, veRL's loss_scale_factor
    if case["rollout_is_weights"]:
        weights = weights * torch.tensor(inputs["rollout_is_weights"], dtype=torch.float32)
    loss = (losses * weights).sum()
    loss.backward()
    assert abs(loss.item() - case["loss"]) < 1e-6
    torch.testing.assert_close(new.grad.double(), torch.tensor(case["grad_log_prob"], dtype=torch.float64), atol=1e-6,
                               rtol=0)
    # one clip fraction: veRL's pg_clipfrac and its dual-clip count pg_clipfrac_lower (disjoint) together
    assert (clipped * mask).sum() / mask.sum() == pytest.approx(case["pg_clipfrac"] + case["pg_clipfrac_lower"],
                                                                abs=1e-6)


@pytest.mark.fast
@pytest.mark.parametrize("case", VERL["cases_trainer_batch_info"], ids=lambda c: f"{c['objective']}-{c['mode']}")
def test_a_row_without_tokens_leaves_the_response_count_unlike_verls_trainer(case):
    """The seq-mean modes: veRL's trainer divides by a minibatch's rows, an empty one too (global_batch_size 7 of the
    fixture's 7 rows, one empty); ppo.py by the rows in the loss (6). A response --overlong-filter drops then
    changes no other response's weight, as DAPO's filter means. The losses differ by exactly 6/7, nothing else."""
    mask = torch.tensor(VERL["inputs"]["response_mask"], dtype=torch.float32)  # (B, T)
    assert case["global_batch_info"]["global_batch_size"] == len(mask) == 7 and (mask.sum(1) == 0).sum() == 1
    ours = next(c for c in VERL["cases"] if (c["objective"], c["mode"], c["rollout_is_weights"]) ==
                (case["objective"], case["mode"], False))  # equal to ppo.py's (the test above)
    assert case["loss"] == pytest.approx(ours["loss"] * 6 / 7, rel=1e-6)
    torch.testing.assert_close(torch.tensor(case["grad_log_prob"]), torch.tensor(ours["grad_log_prob"]) * 6 / 7)
    keep = mask.sum(1) > 0  # (B,): ppo.py's weights of the other rows, with the empty row and without it
    weights = [ppo.loss_weights(m, m.sum(1), m.sum(), (m.amax(1) > 0).sum(), MODES[case["mode"]], VERL["T"])
               for m in (mask, mask[keep])]
    torch.testing.assert_close(weights[0][keep], weights[1], rtol=0, atol=0)


@pytest.mark.parametrize("objective", ["gspo", "cispo"])
def test_the_2025_objectives_train_the_toy_world(world, objective):
    rows = run(f"test_{objective}", "--policy-loss", objective, "--adv-estimator", "grpo", "--group-size", "4",
               "--num-minibatches", "2")
    assert all(r["ppo/policy/ratio_at_start"] < 1e-5 for r in rows)  # one response's ratio: 1 before any step too
    assert all(math.isfinite(r["ppo/loss/policy_avg"]) for r in rows)
    if objective == "gspo":  # at 3e-4 / 4e-4 the second minibatch's responses have left the band
        assert all(r["ppo/policy/clipfrac_avg"] > 0 for r in rows)
    a = AutoModelForCausalLM.from_pretrained(f"runs/test_{objective}/policy").lm_head.weight
    assert not torch.equal(a, AutoModelForCausalLM.from_pretrained("runs/toy/policy").lm_head.weight)
