"""Less model work per update (issue 52): the old log-probs without a pass (--old-logprobs on-policy, sampler), no
reference at beta 0, AdamW's fused kernel. Each saving removes exactly the pass it claims, and changes the update
no more than fp32's rounding where it claims to change nothing."""
import math

import pytest
import torch

import ppo
from fp32 import EPS, assert_close_fp32, fp32_tolerance, logprob_tolerance
from test_in_process import run_main
from test_ppo_parts import checked, rollout_batch

ONE_STEP = dict(num_ppo_epochs=1, num_minibatches=1, kl_coef=0.0)  # on-policy by construction


def passes(monkeypatch, **flags):
    """One update of the toy world: the log-prob passes it ran, as (which model, with a gradient or not)."""
    calls, real = [], ppo.policy_logprobs

    def counted(model, *a, **kw):
        calls.append((type(model).__name__, torch.is_grad_enabled()))
        return real(model, *a, **kw)
    monkeypatch.setattr(ppo, "policy_logprobs", counted)
    monkeypatch.setattr(ppo, "chunked_head_works", lambda model, device: True)  # (its own 8-token probes)
    rows = run_main("test_passes", **flags)
    return sorted(calls), rows[0]


@pytest.mark.fast
def test_each_saving_removes_exactly_the_pass_it_claims(world, monkeypatch):
    """Log-prob passes of one update of 64 rollouts in one micro-batch (the reference is the same class as the
    policy: it is told apart by the count): the textbook's three, then one fewer for each saving."""
    policy, ref = ("LlamaForCausalLM", False), ("LlamaForCausalLM", False)
    train = ("LlamaForCausalLM", True)
    textbook, row = passes(monkeypatch, **ONE_STEP, unread_reference=True)  # auto: the reference's KL reads them
    assert textbook == sorted([policy, ref, train]) and row["objective/kl"] == 0  # (update 1: policy = reference)
    no_ref, row = passes(monkeypatch, **ONE_STEP, old_logprobs="recompute")
    assert no_ref == sorted([policy, train]) and "objective/kl" not in row and "objective/kl_k1" not in row
    neither, row = passes(monkeypatch, **ONE_STEP)  # auto: on-policy
    assert neither == [train] and row["objective/entropy"] > 0  # the entropy from the training forward
    sampler, _ = passes(monkeypatch, old_logprobs="sampler")  # 4 epochs, beta 0.05: the reference's pass alone
    assert sampler == sorted([ref] + [train] * 4)


def backward(world, old_logprobs, sampler_gap=0.0, **flags):
    """One minibatch's gradient on a real rollout; the rollout as phase 7 leaves it (its log-probs, entropies).
    The sampler's log-probs are the trainer's, less `sampler_gap` nats on every token."""
    policy, critic, rollout, P = rollout_batch(world)
    with torch.no_grad():  # what phase 3's pass gives: the entropies (and the log-probs rollout_batch took)
        rollout.entropy = ppo.policy_logprobs(policy, rollout.query_responses, rollout.attention_mask, P, 0.7,
                                              with_entropy=True)[1] * rollout.mask
    pass_logprobs, pass_entropy = rollout.logprobs.clone(), rollout.entropy.clone()
    rollout.engine_logprobs = pass_logprobs - sampler_gap * rollout.mask  # a sampler that agrees, or is that far
    if old_logprobs != "recompute":  # no pass: phase 7 fills what it gave
        rollout.entropy = torch.zeros_like(rollout.entropy)
    if old_logprobs == "on-policy":
        rollout.logprobs = torch.zeros_like(rollout.logprobs)
    args = checked(**ONE_STEP, old_logprobs=old_logprobs, micro_batch_size=8, response_length=12, **flags)
    stats = ppo.minibatch_backward(policy, critic, rollout, torch.arange(32), P, args)
    grads = torch.cat([p.grad.flatten() for m in (policy, critic) for p in m.parameters()])
    return grads, rollout, stats, (pass_logprobs, pass_entropy)


@pytest.mark.fast
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_the_on_policy_shortcut_equals_the_recomputed_path(world, loss_agg):
    """The training forward's own log-probs, detached, as the old ones: the gradient, and the log-probs and entropies
    it leaves in the rollout, are the recomputed path's to fp32 rounding (two forwards of the same rows in other
    micro-batch shapes); the health check then reads the sampler's log-probs, and finds the ratio 1."""
    textbook, _, _, (pass_logprobs, pass_entropy) = backward(world, "recompute", loss_agg=loss_agg)
    gap = 0.01  # the sampler 0.01 nats below the trainer: the check must read it (the shortcut's own give ratio 1)
    shortcut, rollout, stats, _ = backward(world, "on-policy", sampler_gap=gap, loss_agg=loss_agg)
    n = int(rollout.mask.sum())
    assert textbook.abs().max() > 0
    assert_close_fp32(shortcut, textbook, n)
    assert_close_fp32(rollout.logprobs, pass_logprobs * rollout.mask, n)  # (0 on padding)
    assert_close_fp32(rollout.entropy, pass_entropy, n)
    # |p_new / p_sampler - 1| = e^(gap + d) - 1 where |d| is within the rounding allowed above, on every CPU
    # (asserting it above 0 with no gap asserted that two orders of a sum round apart: another CPU's may not)
    d = fp32_tolerance(pass_logprobs, n)
    assert abs(stats["ratio_dev"] / stats["tokens"] - math.expm1(gap)) <= math.exp(gap) * math.expm1(d) + n * EPS


@pytest.mark.fast
def test_the_sampler_path_equals_the_recomputed_path_when_the_sampler_agrees(world):
    """--old-logprobs sampler with a sampler whose log-probs are the trainer's: the same loss and gradient, bit for
    bit; the entropies come from the training forward."""
    textbook, _, stats_a, (_, pass_entropy) = backward(world, "recompute")
    sampler, rollout, stats_b, _ = backward(world, "sampler")
    assert torch.equal(sampler, textbook) and stats_a["pg_loss"] == stats_b["pg_loss"]
    assert_close_fp32(rollout.entropy, pass_entropy, int(rollout.mask.sum()))


def rollouts_logged(monkeypatch):
    """Each update's rollout as its metrics are taken from it."""
    seen, real = [], ppo.metrics_row

    def spy(update, args, rollout, *a, **kw):
        seen.append(rollout)
        return real(update, args, rollout, *a, **kw)
    monkeypatch.setattr(ppo, "metrics_row", spy)
    return seen


def initial_pass(world, rollout, rows):
    """The untrained policy's log-probs and entropies (b, T) on `rows` of a rollout: phase 3's pass, had it run.
    Also how far a token's entropy may round apart in fp32: if every log p_i moves by at most e, H = -sum p log p
    moves by at most e (1 + H) <= e (1 + log V)."""
    from transformers import AutoModelForCausalLM
    policy = AutoModelForCausalLM.from_pretrained(world[0]).eval()
    P = rollout.query_responses.shape[1] - rollout.mask.shape[1]
    with torch.no_grad():
        logprobs, entropy, _ = ppo.policy_logprobs(policy, rollout.query_responses[rows],
                                                   rollout.attention_mask[rows], P, 0.7, with_entropy=True)
    return logprobs, entropy, logprob_tolerance(policy) * (1 + math.log(policy.config.vocab_size))


@pytest.mark.fast
def test_without_a_pass_the_metrics_cover_every_response_token(world, monkeypatch):
    """Issue 62: on-policy with DAPO's overlong filter, the cut responses leave the loss but not the metrics: the
    entropy and the sampler's gap are filled on every response token (they were filled on the loss mask alone and
    averaged over all tokens: entropy 1.07 against 1.48, a gap of 0.385 nats against 4e-7)."""
    seen = rollouts_logged(monkeypatch)
    row = run_main("test_fill_overlong", **ONE_STEP, overlong_filter=True, response_length=4)[0]
    r, rows = seen[0], torch.arange(len(seen[0].lengths))
    assert 0 < row["ppo/val/eos_rate"] < 1  # some responses cut, out of the loss
    logprobs, entropy, entropy_tol = initial_pass(world, r, rows)
    assert abs(row["objective/entropy"] - ppo.masked_mean(entropy, r.mask).item()) <= entropy_tol
    assert row["rollout/logprob_diff_mean"] <= logprob_tolerance(world[0])  # the sampler and trainer agree in fp32


@pytest.mark.fast
def test_an_early_stop_without_a_pass_reports_the_entropy_of_the_tokens_it_saw(world, monkeypatch):
    """Issue 62: --old-logprobs sampler, --target-kl stopping after the first minibatch (a bf16 sampler's gap
    exceeds it before any step): the entropy is the mean over that minibatch's tokens, as the untrained policy gives
    them, not a mean that counts the other minibatches' unfilled tokens as 0 (0.70 against 1.42)."""
    seen = rollouts_logged(monkeypatch)
    flags = dict(old_logprobs="sampler", sampler_precision="bf16", num_minibatches=4, target_kl=1e-12)
    row = run_main("test_fill_early_stop", **flags)[0]
    r = seen[0]
    first = ppo.minibatch_order(checked(**flags), 1, 0, len(r.lengths))[:len(r.lengths) // 4]  # (B/4,)
    assert row["ppo/epochs"] == 1 and row["time/trained_tokens"] == r.mask[first].sum()  # stopped after it
    _, entropy, entropy_tol = initial_pass(world, r, first)
    assert abs(row["objective/entropy"] - ppo.masked_mean(entropy, r.mask[first]).item()) <= entropy_tol
    assert "rollout/logprob_diff_mean" not in row  # (the old log-probs are the sampler's: no trainer's to compare)


@pytest.mark.mutants  # (a minute: outside the fast subset; the mutation check runs it)
def test_without_a_pass_the_health_check_measures_the_sampler(world):
    """On-policy, the ratio against the old log-probs is 1 by construction: the check compares the training forward
    with the sampler's log-probs instead. An fp32 sampler agrees to incremental decoding's rounding; a bf16 one shows
    its gap (the same figure the rollout/ metrics give), and a tight tolerance stops the run on it."""
    fp32 = run_main("test_health_fp32", **ONE_STEP, adv_estimator="grpo", group_size=4)
    assert all(r["ppo/policy/ratio_at_start"] < 1e-5 for r in fp32)
    bf16 = run_main("test_health_bf16", **ONE_STEP, adv_estimator="grpo", group_size=4, sampler_precision="bf16")
    assert all(1e-4 < r["ppo/policy/ratio_at_start"] < 5e-2 for r in bf16)
    with pytest.raises(ppo.UsageError, match="before any step"):
        run_main("test_health_tight", **ONE_STEP, adv_estimator="grpo", group_size=4, sampler_precision="bf16",
                 ratio_check_tol=1e-5)


def test_an_agents_observations_never_take_a_sampler_value(monkeypatch):
    """--old-logprobs sampler on the guess world's episodes: the old log-probs are the sampler's on the agent's
    tokens and 0 on the observations (off the mask), whatever the rows hold there."""
    seen, real = [], ppo.minibatch_backward

    def spy(policy, critic, rollout, *a, **kw):
        seen.append(rollout)
        return real(policy, critic, rollout, *a, **kw)
    monkeypatch.setattr(ppo, "minibatch_backward", spy)
    rows = run_main("test_sampler_guess", model="guess", old_logprobs="sampler", total_episodes=32, batch_size=32)
    r = seen[0]
    assert rows[0]["env/turns"] > 1 and ((1 - r.mask) * r.attention_mask[:, -r.mask.shape[1]:]).sum() > 0
    assert torch.equal(r.logprobs, r.engine_logprobs * r.mask) and r.logprobs[r.mask == 0].eq(0).all()
    agent = r.logprobs[r.mask == 1]  # a token the world is sure of rounds to log p = 0 in fp32 (how many: by CPU)
    assert (agent <= 0).all() and (agent < 0).any()


@pytest.mark.fast
def test_adamw_is_fused_where_torch_has_the_kernel_and_says_which_ran():
    said = []
    p = torch.nn.Parameter(torch.ones(3))
    assert ppo.adamw([p], 1e-3, True, "policy", said.append).defaults["fused"] and said == ["policy's AdamW: fused"]
    assert not ppo.adamw([p], 1e-3, False, "policy", said.append).defaults["fused"]
    meta = torch.nn.Parameter(torch.ones(3, device="meta"))  # a device torch has no fused kernel for: no refusal
    assert not ppo.adamw([meta], 1e-3, True, "critic", said.append).defaults["fused"]
    assert said[-1] == "critic's AdamW: torch's default, no fused kernel here"


def test_lora_and_two_ranks_run_the_fused_kernel(world, capsys):
    run_main("test_fused_lora", lora_rank=4, total_episodes=32, batch_size=32)
    assert "policy's AdamW: fused" in capsys.readouterr().out


@pytest.mark.fast
def test_at_beta_0_no_kl_term_reads_the_reference_that_was_not_run(world, monkeypatch, capsys):
    """Issue 62: at beta 0 no reference runs, so no KL is taken against its zeros (k3 of a log-prob below -88.7
    overflows, and 0 x inf is NaN): not in the reward, not in the loss (--kl-in-loss). A --ref-model there would never
    be read: refused in one line; --unread-reference at beta > 0 changes nothing, and the run says so."""
    calls, real = [], ppo.kl_penalty
    monkeypatch.setattr(ppo, "kl_penalty", lambda *a: calls.append(a[0].shape) or real(*a))
    rows = run_main("test_beta0_kl", kl_coef=0.0, kl_in_loss=True, kl_estimator="k3", adv_estimator="grpo",
                    group_size=4)
    assert [c for c in calls if c != (1, 1)] == [] and "objective/kl" not in rows[0]  # (check_args' probe: 1 x 1)
    with pytest.raises(ppo.UsageError, match="--ref-model at --kl-coef 0"):
        ppo.check_args(ppo.Args(kl_coef=0.0, ref_model="toy"), 1)
    ppo.check_args(ppo.Args(kl_coef=0.0, ref_model="toy", unread_reference=True), 1)  # (loaded and run: allowed)
    run_main("test_unread_beta", unread_reference=True, num_ppo_epochs=1)
    assert "note: --unread-reference changes nothing at --kl-coef > 0" in capsys.readouterr().out
