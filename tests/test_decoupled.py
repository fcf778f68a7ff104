"""--rollout-correction decoupled against AReaL's own decoupled PPO actor loss (Fu et al. 2025, arXiv 2505.24298),
recorded by tests/areal_decoupled.py (AReaL is not installed here): AReaL 1.0.4's ppo_actor_loss_fn with
rejection_sampling {level token, action mask, metric ratio, upper 5} and the paper-era one (commit 61d1bbb) with
behav_imp_weight_cap=5, on the same inputs. AReaL's proximal log-probs are ppo.py's old (the trainer's, at rollout
time), its old_logprobs the behaviour policy's: ppo.py's sampler log-probs."""
import json
import os

import pytest
import torch

import ppo

AREAL = json.load(open(os.path.join(os.path.dirname(__file__), "areal_decoupled.json")))
HOLE_ROW, OBSERVATION = AREAL["rows"]["hole"], slice(4, 7)  # the hole row's observation tokens: wild log-probs
PAPER, NOW = AREAL["areal_61d1bbb"], AREAL["areal_1_0_4"]


def f64(x):
    return torch.tensor(x, dtype=torch.float64)


def ppo_side(mode, high=None):
    """ppo.py's policy loss as minibatch_backward composes it, in float64 (as AReaL ran): the loss, d loss / d logp,
    rollout_correction's weights, kept mask and corrected tokens, the clipped indicator, the checked args."""
    inputs, clip = AREAL["inputs"], AREAL["clip"]
    mask, proximal, adv = f64(inputs["loss_mask"]), f64(inputs["proximal_logprobs"]), f64(inputs["advantages"])
    args = ppo.Args(rollout_correction=mode, rollout_correction_high=high, sampler_precision="bf16",
                    clip_eps=clip["eps_clip"], clip_eps_high=clip["eps_clip_higher"], dual_clip=clip["c_clip"],
                    loss_agg="token-mean")  # AReaL's actor: a token mean over the minibatch
    ppo.check_args(args, 1)  # fills the mode's default bounds
    weights, kept, corrected = ppo.rollout_correction(proximal, f64(inputs["old_logprobs"]), mask, mode,
                                                      args.rollout_correction_low, args.rollout_correction_high)
    new = f64(inputs["logprobs"]).requires_grad_()
    pg_losses, _, _, clipped = ppo.policy_objective(torch.where(kept.bool(), new, proximal), proximal, adv, kept, args)
    agg = ppo.loss_weights(kept, kept.sum(1), kept.sum().clamp(min=1), (kept.amax(1) > 0).sum(), args.loss_agg,
                           AREAL["T"])
    loss = (pg_losses * agg * weights).sum()
    loss.backward()
    return loss.item(), new.grad, weights, kept, corrected, clipped, args


@pytest.mark.fast
def test_decoupled_equals_areals_decoupled_ppo_loss_in_weights_mask_loss_and_gradient():
    loss, grad, weights, kept, corrected, clipped, args = ppo_side("decoupled")
    assert (args.rollout_correction_low, args.rollout_correction_high) == (0.0, 5.0) == (0.0, AREAL["cap"])
    mask = f64(AREAL["inputs"]["loss_mask"])
    areal_kept = f64(PAPER["behave_mask"])  # the tokens under the cap: both versions keep the same
    assert torch.equal(areal_kept, f64(NOW["behave_mask"]))
    # capped tokens leave the numerator only: AReaL divides by the tokens before its cap (loss_mask_count)
    assert torch.equal(kept, mask)
    torch.testing.assert_close(weights, f64(PAPER["behave_imp_weight"]), rtol=1e-12, atol=0)  # 0 where capped
    assert torch.equal(corrected, mask - areal_kept)  # what ppo.py logs as corrected: exactly AReaL's capped tokens
    share = (corrected.sum() / mask.sum()).item()
    assert share == NOW["filtered_fraction"] and 0 < share < 1  # the cap bound on some tokens, not on all
    assert (weights[HOLE_ROW, OBSERVATION] == 0).all()
    # the paper's code ran in float64: to its last digits
    assert loss == pytest.approx(PAPER["loss"], rel=1e-12, abs=1e-15)
    torch.testing.assert_close(grad, f64(PAPER["grad_logprobs"]), rtol=1e-12, atol=1e-15)
    # 1.0.4 takes the behaviour weight in float32 (its .float() upcast, a downcast here): to float32's resolution
    assert loss == pytest.approx(NOW["loss"], rel=1e-6)
    torch.testing.assert_close(grad, f64(NOW["grad_logprobs"]), rtol=1e-6, atol=1e-12)
    # ... and in float32, as ppo.py's log-probs are, its weights are 1.0.4's to an ulp
    inputs = AREAL["inputs"]
    fp32 = ppo.rollout_correction(torch.tensor(inputs["proximal_logprobs"]), torch.tensor(inputs["old_logprobs"]),
                                  mask.float(), "decoupled", 0.0, 5.0)[0]
    torch.testing.assert_close(fp32, torch.tensor(NOW["behave_imp_weight"], dtype=torch.float32), rtol=1.2e-7, atol=0)
    # the clip (eps and dual) binds where AReaL's does, on the tokens its cap keeps
    areal_clipped = f64(NOW["clip_mask"]).bool() | f64(NOW["dual_clip_mask"]).bool()
    assert torch.equal((clipped * areal_kept).bool(), areal_clipped) and f64(NOW["dual_clip_mask"]).sum() > 0


@pytest.mark.fast
def test_truncating_at_the_cap_is_not_areals_loss():
    """The check can fail: token-is at the same cap 5 clamps the weights above it to 5 (truncated IS) instead of
    zeroing them, and its loss and gradient leave AReaL's."""
    loss, grad, weights, kept, corrected = ppo_side("token-is", high=AREAL["cap"])[:5]
    assert torch.equal(corrected, f64(AREAL["inputs"]["loss_mask"]) - f64(PAPER["behave_mask"]))  # the same tokens
    assert (weights[corrected.bool()] == 5).all()
    assert abs(loss - PAPER["loss"]) > 1e-3 * abs(PAPER["loss"])
    assert (grad - f64(PAPER["grad_logprobs"])).abs().max() > 1e-3
