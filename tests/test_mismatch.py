"""--rollout-correction: each mode against veRL 0.9.1's own helper (recorded by tests/verl_rollout_corr.py; veRL is
not installed here), then each acting on a real gap between sampler and trainer: HF sampling under bf16 autocast
against an fp32 trainer, and the vLLM engine in bf16 (--sampler-precision bf16)."""
import json
import os
import shutil

import pytest
import torch

import ppo
import runfiles
from fp32 import EPS, assert_close_fp32, logprob_tolerance
from test_in_process import run_main
from test_ppo_parts import checked, rollout_batch
from test_variants import MODES as AGG

VERL = json.load(open(os.path.join(os.path.dirname(__file__), "verl_rollout_corr.json")))
HOLE_ROW, OBSERVATION = VERL["rows"]["hole"], slice(4, 7)
VERL_MODES = [m for m in ppo.ROLLOUT_CORRECTIONS if m != "decoupled"]  # (AReaL's: tests/test_decoupled.py)  # the hole row's observation tokens: wild log-ratios


def verl_case(mode):
    return next(c for c in VERL["cases"] if c["mode"] == mode)


@pytest.mark.fast
@pytest.mark.parametrize("mode", VERL_MODES)
def test_each_rollout_correction_equals_verl_in_weights_mask_loss_and_gradient(mode):
    """At the mode's default bounds (so the defaults are veRL's setting too), in float64 as veRL ran: the IS weights,
    the mask left to the losses, and veRL's vanilla PPO loss with both (value and d loss / d log-prob) against
    ppo.py's loss as minibatch_backward sums it, for token-mean and seq-mean-token-mean."""
    case, inputs = verl_case(mode), VERL["inputs"]
    f64 = lambda x: torch.tensor(x, dtype=torch.float64)
    mask, old, adv = f64(inputs["response_mask"]), f64(inputs["old_log_prob"]), f64(inputs["advantages"])
    args = ppo.Args(rollout_correction=mode, sampler_precision="bf16")
    ppo.check_args(args, 1)  # fills the mode's default bounds
    weights, kept, corrected = ppo.rollout_correction(old, f64(inputs["rollout_log_prob"][mode]), mask, mode,
                                                      args.rollout_correction_low, args.rollout_correction_high)
    assert torch.equal(kept, f64(case["kept"]))
    if case["is_weights"] is not None:
        torch.testing.assert_close(weights, f64(case["is_weights"]), rtol=1e-12, atol=0)
    else:
        assert torch.equal(weights, torch.ones_like(mask))
    assert (kept[HOLE_ROW, OBSERVATION] == 0).all() and (weights * mask)[HOLE_ROW, OBSERVATION].eq(0).all()
    # what ppo.py logs as the share corrected is veRL's own count of it
    metrics = case["metrics"]
    share = (corrected.sum() / mask.sum()).item()
    if mode in ("token-is", "icepop"):  # tokens capped (above the cap) or zeroed (outside the bounds)
        veRL = metrics["rollout_corr/rollout_is_ratio_fraction_high"] + (
            metrics["rollout_corr/rollout_is_ratio_fraction_low"] if mode == "icepop" else 0)
        assert share == pytest.approx(veRL, abs=1e-7) and 0 < share < 1  # (veRL counts in fp32)
    elif mode.endswith("mask"):
        assert share == pytest.approx(metrics["rollout_corr/rollout_rs_masked_fraction"], abs=1e-7) and 0 < share < 1
        assert corrected.amax(1).mean().item() == pytest.approx(metrics["rollout_corr/rollout_rs_seq_masked_fraction"])
    for agg in ("token-mean", "seq-mean-token-mean"):
        new = f64(inputs["log_prob"]).requires_grad_()
        run = ppo.Args(clip_eps=VERL["clip"]["clip_ratio_low"], clip_eps_high=VERL["clip"]["clip_ratio_high"],
                       dual_clip=VERL["clip"]["clip_ratio_c"], loss_agg=AGG[agg])
        ppo.check_args(run, 1)
        losses = ppo.policy_objective(torch.where(kept.bool(), new, old), old, adv, kept, run)[0]  # (B, T)
        agg_weights = ppo.loss_weights(kept, kept.sum(1), kept.sum(), (kept.amax(1) > 0).sum(), run.loss_agg, VERL["T"])
        loss = (losses * agg_weights * weights).sum()
        loss.backward()
        assert loss.item() == pytest.approx(case[agg]["loss"], rel=1e-12, abs=1e-15), agg
        torch.testing.assert_close(new.grad, f64(case[agg]["grad_log_prob"]), rtol=1e-10, atol=1e-15)


@pytest.mark.fast
def test_observation_tokens_never_reach_a_correction():
    """Whatever the sampler and the trainer say of an episode's observation tokens (off the mask), every mode gives
    the same weights and mask on the agent's tokens, and nothing on the observation's."""
    inputs = VERL["inputs"]
    mask, old = torch.tensor(inputs["response_mask"]), torch.tensor(inputs["old_log_prob"])
    for mode in VERL_MODES:
        low, high = ppo.ROLLOUT_CORRECTIONS[mode][1:]
        sampler = torch.tensor(inputs["rollout_log_prob"][mode])
        wild = sampler.clone()
        wild[HOLE_ROW, OBSERVATION] = -1e4  # what a sampler never gave an observation token
        a, b = (ppo.rollout_correction(old, s, mask.float(), mode, low, high) for s in (sampler, wild))
        for x, y in zip(a, b):
            assert torch.equal(x * mask, y * mask), mode
        assert (a[1] * (1 - mask)).eq(0).all() and (a[2] * (1 - mask)).eq(0).all(), mode


def gradient(world, loss_agg, rows=None, kept=None, is_weights=None):
    policy, critic, rollout, P = rollout_batch(world)
    rollout.kept, rollout.is_weights = kept, is_weights
    args = checked(loss_agg=loss_agg, response_length=12, micro_batch_size=8, sampler_precision="bf16",
                   rollout_correction="token-is" if kept is not None or is_weights is not None else None)
    ppo.minibatch_backward(policy, critic, rollout, torch.arange(32) if rows is None else rows, P, args)
    return [torch.cat([p.grad.flatten() for p in m.parameters()]) for m in (policy, critic)]


@pytest.mark.fast
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-sum-norm"])
def test_the_gradients_scale_does_not_depend_on_how_many_responses_a_mask_drops(world, loss_agg):
    """Masked responses leave the policy and the value loss and their normalisers: the gradient of a minibatch of the
    responses kept alone, whatever the aggregation. (veRL 0.9.1's trainer divides its seq-mean losses by the
    minibatch's rows, global_batch_size = ppo_mini_batch_size, rejected ones included: its step shrinks by the share
    its mask drops; ppo.py divides by the responses kept, as both divide a token-mean by the tokens kept; see
    docs/mismatch.md.) IS weights multiply the policy loss only: weights of 2 double the policy's gradient."""
    plain = gradient(world, loss_agg)
    rollout_mask = rollout_batch(world)[2].mask  # (32, T)
    out = torch.arange(32) % 3 == 0  # (32,): as a sequence mask drops them
    masked = gradient(world, loss_agg, kept=rollout_mask * ~out[:, None], is_weights=torch.ones_like(rollout_mask))
    kept_alone = gradient(world, loss_agg, rows=torch.nonzero(~out).squeeze(1))
    for a, b in zip(masked, kept_alone):  # other micro-batches: the same sums in other orders
        assert_close_fp32(a, b, int(rollout_mask.sum()))
    assert (masked[0] - plain[0]).abs().max() > 1e-4
    doubled = gradient(world, loss_agg, kept=rollout_mask, is_weights=2 * torch.ones_like(rollout_mask))
    assert_close_fp32(doubled[0], 2 * plain[0], int(rollout_mask.sum()))
    torch.testing.assert_close(doubled[1], plain[1], atol=0, rtol=0)  # the critic's untouched


# bounds that a bf16 sampler's gap on the toy world (mean |log-prob difference| about 8e-3) crosses for some tokens
TIGHT = {"token-is": (None, 1.01), "seq-is": (None, 1.01), "icepop": (0.99, 1.01), "token-mask": (0.99, 1.01),
         "seq-mask": (0.97, 1.03), "geo-mask": (0.999, 1.001)}


@pytest.mark.parametrize("mode", list(TIGHT))
def test_each_mode_acts_on_the_gap_of_a_bf16_sampler(world, mode, monkeypatch):
    """HF samples under bf16 autocast, the trainer scores in fp32: a real gap. Each mode corrects part of the
    tokens (masks: those leave the losses), the health check still sees a ratio of 1 against the trainer's own.
    The IS weights are checked against the log-probs the correction was given, not against 1: under the sampler's
    distribution the mean of p_trainer / p_sampler is 1 in expectation, so another CPU's bf16 kernels put the
    sample mean on either side of it (an AMD EPYC gave 1.0006 where this test once asserted < 1)."""
    low, high = TIGHT[mode]
    calls, correct = [], ppo.rollout_correction

    def recorded(*inputs):  # the real correction; its inputs and outputs kept as they were at the call
        out = correct(*inputs)
        calls.append([[x.clone() if torch.is_tensor(x) else x for x in xs] for xs in (inputs, out)])
        return out
    monkeypatch.setattr(ppo, "rollout_correction", recorded)
    rows = run_main(f"test_gap_{mode}", sampler_precision="bf16", precision="fp32", rollout_correction=mode,
                    rollout_correction_low=low, rollout_correction_high=high)
    calls = [c for c in calls if c[0][0].shape != (1, 1)]  # (check_args's probe of the mode's branch left out)
    assert len(calls) == len(rows)
    for r, ((trainer, sampler, mask, *_), (weights, kept, corrected)) in zip(rows, calls):
        assert 1e-3 < r["rollout/logprob_diff_mean"] < 0.1 and r["rollout/kl"] != 0
        assert 0 < r["rollout/corrected_tokens"] < 1 and 0 < r["rollout/corrected_responses"] <= 1
        assert r["ppo/policy/ratio_at_start"] < 1e-5
        trained = r["time/trained_tokens"] / (r["time/generated_tokens"] * r["ppo/epochs"])  # (one rank)
        if mode.endswith("mask"):
            assert trained == pytest.approx(1 - r["rollout/corrected_tokens"]) and r["rollout/is_weight_mean"] == 1
            continue
        assert trained == 1 and torch.equal(kept, mask)  # the IS modes weigh tokens and drop none
        log_ratio = (trainer - sampler) * mask  # (B, T): log p_trainer / p_sampler, from the correction's inputs
        if mode == "seq-is":
            log_ratio = log_ratio.sum(1, keepdim=True)  # (B, 1): one ratio a response
        ratio = (torch.exp(log_ratio.clamp(-20, 20)) * mask).double()  # (B, T)
        on, off = mask.bool() & corrected.bool(), mask.bool() & ~corrected.bool()  # (B, T): changed or not
        ulps = 4 * EPS  # exp is within an ulp or two of exact on any CPU; a few ulps cover it and the bounds' rounding
        torch.testing.assert_close(weights[off].double(), ratio[off], rtol=ulps, atol=0)  # the rest: their ratio
        if mode == "icepop":  # zeroed where the ratio leaves [low, high], and only there
            assert (weights[on] == 0).all() and ((ratio[on] < low * (1 + ulps)) | (ratio[on] > high * (1 - ulps))).all()
            assert ((ratio[off] >= low * (1 - ulps)) & (ratio[off] <= high * (1 + ulps))).all()
        else:  # a cap: a capped token's weight is the cap itself, and only ratios above it are capped
            assert (weights[on] == torch.tensor(high)).all() and (ratio[on] >= high * (1 - ulps)).all()
            assert (ratio[off] <= high * (1 + ulps)).all()
        expected = torch.where(on, 0.0 if mode == "icepop" else high, ratio)  # (B, T): float64
        n = int(mask.sum())  # the logged mean: a float32 sum of n positive terms, n * eps apart from exact at most
        assert r["rollout/is_weight_mean"] == pytest.approx((expected * mask).sum().item() / n, rel=2 * n * EPS)


@pytest.mark.mutants  # outside the fast subset for its time; the mutation check runs it
def test_a_sampler_in_the_trainers_precision_has_no_gap_to_correct(world):
    rows = run_main("test_gap_none", sampler_precision="fp32", precision="fp32", rollout_correction="token-mask")
    assert all(r["rollout/logprob_diff_max"] < 1e-4 and r["rollout/corrected_tokens"] == 0 for r in rows)


@pytest.mark.fast
def test_a_filtered_sampler_scores_its_tokens_on_the_support_the_trainer_renormalises_on(world):
    """Issue 62: top-p with the kept mask, sampler and trainer both in fp32. The sampler's log-probs are taken on the
    filtered support, as the trainer's are, so the two agree to within fp32's rounding: the tightest mask (geo-mask,
    1 +- 1e-3) corrects no token and every token trains. (Taken on the whole vocabulary they were 0.117 nats apart a
    token: every token corrected, none trained.)"""
    rows = run_main("test_gap_top_p", top_p=0.8, keep_sampling_mask=True, sampler_precision="fp32", precision="fp32",
                    rollout_correction="geo-mask")
    tol = logprob_tolerance(world[0])  # (2.4e-4 < log 1.001: the mask's bound is not where the rounding lands)
    for r in rows:
        assert r["rollout/logprob_diff_max"] < tol and r["rollout/corrected_tokens"] == 0
        assert r["time/trained_tokens"] == r["time/generated_tokens"] * r["ppo/epochs"] > 0


def test_a_multi_turn_episode_is_corrected_on_its_agent_tokens(world):
    """The guess world's episodes: the bf16 sampler's log-probs per turn, 0 on the observations (off the mask)."""
    rows = run_main("test_gap_guess", model="guess", sampler_precision="bf16", precision="fp32",
                    rollout_correction="seq-mask", rollout_correction_low=0.97, rollout_correction_high=1.03)
    for r in rows:
        assert 1e-4 < r["rollout/logprob_diff_mean"] < 0.1 and r["env/turns"] > 1
        assert 0 < r["rollout/corrected_tokens"] < 1
        trained = r["time/trained_tokens"] / (r["time/generated_tokens"] * r["ppo/epochs"])
        assert trained == pytest.approx(1 - r["rollout/corrected_tokens"])


def test_a_correction_needs_a_sampler_apart_from_the_trainer():
    with pytest.raises(ppo.UsageError, match="add --vllm, --sampler-precision or --async-steps 1"):
        ppo.check_args(ppo.Args(rollout_correction="seq-mask"), 1)
    with pytest.raises(ppo.UsageError, match="--rollout-correction-low must be at most"):
        ppo.check_args(ppo.Args(rollout_correction="icepop", vllm=True, rollout_correction_low=6.0), 1)


@pytest.mark.fast
def test_a_checkpoint_of_the_old_cap_flag_is_not_resumed_without_it(tmp_path):
    """--rollout-is-cap (before issue 43) is gone: a checkpoint that used it names it rather than resuming
    without its correction; one that left it off resumes (the new flags at their defaults)."""
    args = ppo.Args()
    ppo.check_args(args, 1)
    saved = json.loads(json.dumps(ppo.asdict(args)))
    (tmp_path / "shards").mkdir()  # (a sharded checkpoint's)
    for cap, refused in ((2.0, True), (None, False)):
        json.dump({**saved, "rollout_is_cap": cap}, open(tmp_path / "flags.json", "w"))
        if refused:
            with pytest.raises(ValueError, match=r"--rollout-is-cap 2\.0 -> None"):
                runfiles.check_same_flags(ppo.asdict(args), str(tmp_path))
        else:
            runfiles.check_same_flags(ppo.asdict(args), str(tmp_path))


@pytest.mark.fast
def test_an_asymmetric_bound_rejects_the_side_the_help_names():
    """--rollout-correction-low/-high bound p_trainer / p_sampler in the IS modes and p_sampler / p_trainer in the
    masks, as their help says: two responses of one token, at the two ratios 2 and 1/2, bounds [0.9, 3]: each mode
    keeps the response whose ratio, as the help names it, is 2, and drops the one at 1/2."""
    low_help = open(ppo.__file__).read().split("rollout_correction_low: OptFloat = None")[1].splitlines()[1]
    assert "p_trainer / p_sampler in IS modes" in low_help and "p_sampler / p_trainer in masks" in low_help, low_help
    trainer, mask = torch.zeros(2, 1), torch.ones(2, 1)  # log p_trainer of each response's token
    sampler = torch.log(torch.tensor([[0.5], [2.0]]))  # p_trainer / p_sampler = 2, then 1/2
    weights = ppo.rollout_correction(trainer, sampler, mask, "icepop", 0.9, 3.0)[0]  # IS: p_trainer / p_sampler
    assert weights.tolist() == [[2.0], [0.0]]
    for mode in ("token-mask", "seq-mask", "geo-mask"):  # masks: p_sampler / p_trainer, 1/2 then 2
        kept = ppo.rollout_correction(trainer, sampler, mask, mode, 0.9, 3.0)[1]
        assert kept.tolist() == [[0.0], [1.0]], mode


@pytest.mark.fast
@pytest.mark.parametrize("mode", VERL_MODES)
def test_a_correction_carries_no_gradient(mode):
    """The weights and masks change the measure, not the objective: given log-probs that require a gradient (a
    fork that corrects against the training pass's own), nothing returned carries one (veRL detaches them too)."""
    inputs = VERL["inputs"]
    logprobs = torch.tensor(inputs["old_log_prob"]).requires_grad_()
    low, high = ppo.ROLLOUT_CORRECTIONS[mode][1:]
    out = ppo.rollout_correction(logprobs, torch.tensor(inputs["rollout_log_prob"][mode]),
                                 torch.tensor(inputs["response_mask"]).float(), mode, low, high)
    assert not any(x.requires_grad for x in out)


@pytest.mark.fast
def test_each_bound_value_has_one_meaning():
    """Issue 62: the branch is the mode's, not the bound's. Ratios p_trainer / p_sampler of 3, 1.5 and 0.2:
    token-is caps them at 2 and takes no lower bound (one given is refused, not turned into a mask); a low of 0 is no
    lower bound in icepop and the masks (it stopped the masks with log(0)); a high of 0 is refused, not the default."""
    trainer, sampler, mask = torch.log(torch.tensor([[3.0, 1.5, 0.2]])), torch.zeros(1, 3), torch.ones(1, 3)

    def bounds(mode, **flags):
        args = ppo.Args(rollout_correction=mode, sampler_precision="bf16", **flags)
        ppo.check_args(args, 1)
        return ppo.rollout_correction(trainer, sampler, mask, mode, args.rollout_correction_low,
                                      args.rollout_correction_high)
    assert bounds("token-is")[0][0].tolist() == pytest.approx([2.0, 1.5, 0.2])
    for low in (0.0, 0.5):
        with pytest.raises(ppo.UsageError, match="has no lower bound"):
            bounds("token-is", rollout_correction_low=low)
    assert bounds("icepop", rollout_correction_low=0.0, rollout_correction_high=2.0)[0][0].tolist() == pytest.approx(
        [0.0, 1.5, 0.2])  # 3 out of bounds; 0.2 kept: no lower bound
    for mode in ("token-mask", "seq-mask", "geo-mask"):  # on p_sampler / p_trainer: 1/3, 2/3, 5
        kept = bounds(mode, rollout_correction_low=0.0, rollout_correction_high=4.0)[1]
        assert kept.tolist() == ([[1.0, 1.0, 0.0]] if mode == "token-mask" else [[1.0, 1.0, 1.0]]), mode
    with pytest.raises(ppo.UsageError, match="--rollout-correction-high must be positive"):
        bounds("icepop", rollout_correction_high=0.0)
