"""What phases 4-7 compute, checked in value against independent computations (float64, row by row), not
only as "the update differs": the per-token rewards, reward whitening, GAE with VAPO's lambdas, the group
baselines, the advantage whitening; the entropy bonus's gradient; the KL in the loss pulling towards the
reference from either side; each prompt's group side by side; the sampler's support on bf16 logits."""
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import ppo
import toy
from fp32 import assert_close_fp32, fp32_tolerance
from test_ppo_parts import checked, rollout_batch

pytestmark = pytest.mark.fast
T_HOT = 1.3


def trained_rollout(monkeypatch, name, **flags):
    """One in-process update of the toy world: the rollout phase 7 trains on (what phases 1-6 made of it),
    and the flags as check_args resolved them."""
    seen, real = [], ppo.minibatch_backward
    monkeypatch.setattr(ppo, "minibatch_backward", lambda policy, critic, rollout, *a, **k: (
        seen.append(rollout), real(policy, critic, rollout, *a, **k))[1])
    shutil.rmtree(f"runs/{name}", ignore_errors=True)
    args = ppo.Args(run_name=name, total_episodes=16, batch_size=16, num_ppo_epochs=1, sample_every=0, save_every=0,
                    **flags)
    ppo.main(args)
    return seen[0], args


def gae_by_hand(rewards, values, lengths, gamma, lams):
    """The textbook recursion, one row at a time, up to each row's length (float64)."""
    adv = np.zeros_like(rewards)
    for i, n in enumerate(lengths):
        last = 0.0
        for t in reversed(range(n)):
            next_value = values[i, t + 1] if t + 1 < n else 0.0  # after the last token: terminal (no bootstrap here)
            last = rewards[i, t] + gamma * next_value - values[i, t] + gamma * lams[i] * last
            adv[i, t] = last
    return adv


def whiten_by_hand(x, mask, shift_mean=True):
    valid = x[mask > 0]
    mean, std = valid.mean(), np.sqrt(valid.var(ddof=1) + 1e-8)
    return ((x - mean) / std + (0 if shift_mean else mean)) * mask


def phases_4_to_6_by_hand(rollout, args):
    """Advantages and returns from the rollout's KL, scores, values and lengths, as the README's loop (phases 4-6) says."""
    mask, lengths = rollout.mask.double().numpy(), rollout.lengths.numpy()
    values, has_eos = rollout.values.double().numpy(), rollout.has_eos.numpy()
    beta = 0.0 if args.kl_in_loss else rollout.kl_coef
    rewards = -beta * rollout.kl.double().numpy()
    rewards[np.arange(len(lengths)), lengths - 1] += rollout.scores.double().numpy()  # on the last real token
    if args.whiten_rewards:
        rewards = whiten_by_hand(rewards, mask, shift_mean=False)
    lam = np.full(len(lengths), args.lam)
    if args.lam_alpha is not None:
        lam = np.clip(1 - 1 / (args.lam_alpha * lengths), 0, 1)
    advantages = gae_by_hand(rewards, values, lengths, args.gamma, lam)
    critic_lam = np.full(len(lengths), args.lam if args.critic_lam is None else args.critic_lam)
    returns = (gae_by_hand(rewards, values, lengths, args.gamma, critic_lam) + values) * mask
    if args.adv_estimator != "gae":
        seq = rewards.sum(1).reshape(-1, args.group_size)  # (prompts, G)
        if args.adv_estimator == "grpo":
            seq_adv = seq - seq.mean(1, keepdims=True)
            if args.group_std:
                seq_adv = seq_adv / (seq.std(1, ddof=1, keepdims=True) + 1e-6)
        else:
            seq_adv = seq - (seq.sum(1, keepdims=True) - seq) / (args.group_size - 1)
        advantages = seq_adv.reshape(-1, 1) * mask
    if args.whiten_advantages:
        advantages = whiten_by_hand(advantages, mask * has_eos[:, None] if args.overlong_filter else mask)
    return advantages, returns


@pytest.mark.parametrize("flags", [
    dict(),
    dict(lam_alpha=0.17),  # 1 - 1 / (0.17 L): negative up to 5 tokens, clamped to 0 (43% of the toy's responses at
    # tau 0.7, so 16 responses lack one ~1e-4 of the time on a world trained on any CPU; at 0.25, 11%)
    dict(critic_lam=1.0, whiten_rewards=True),
    dict(adv_estimator="grpo", group_size=4),
    dict(adv_estimator="rloo", group_size=4, kl_in_loss=True),
    dict(adv_estimator="grpo", group_size=4, group_std=False, whiten_advantages=True),
    dict(overlong_filter=True, response_length=5),
], ids=["gae", "lam-alpha", "critic-lam+whiten-rewards", "grpo", "rloo+kl-in-loss", "dr-grpo+whiten", "overlong"])
def test_phases_4_to_6_equal_a_computation_by_hand(world, monkeypatch, flags):
    rollout, args = trained_rollout(monkeypatch, "test_values", **flags)
    lengths, mask = rollout.lengths, rollout.mask
    if args.lam_alpha is not None:  # the clamp matters here, and the lambdas differ from row to row
        assert (lengths < 1 / args.lam_alpha).any() and len(set(lengths.tolist())) > 1
    if args.overlong_filter:
        assert rollout.has_eos.any() and not rollout.has_eos.all()
    if args.adv_estimator != "gae":  # each group: the same prompt G times
        prompts = rollout.query_responses[:, :rollout.query_responses.shape[1] - mask.shape[1]]
        groups = prompts.view(-1, args.group_size, prompts.shape[1])
        assert (groups == groups[:, :1]).all() and not (groups[1:, 0] == groups[:-1, 0]).all()
    assert args.whiten_advantages == (args.adv_estimator == "gae" or "whiten_advantages" in flags)
    advantages, returns = phases_4_to_6_by_hand(rollout, args)
    n = int(mask.numel())  # whitening sums over every token of the batch
    assert_close_fp32(rollout.advantages.double(), torch.from_numpy(advantages), n)
    if args.adv_estimator == "gae":
        assert_close_fp32(rollout.returns.double(), torch.from_numpy(returns), n)


def test_a_group_with_one_score_gets_no_advantage(world, monkeypatch):
    """GRPO's groups are not whitened again over tokens by default: a group whose samples all scored the same
    carries no signal, and its tokens get 0, not the shift that whitening over all tokens gives it (a length
    bias under per-response aggregation)."""
    def scores(models, args, rows, *a):  # the first group all 0; one sample of each other group scores 1
        return torch.tensor([float(i >= 4 and i % 4 == 0) for i in range(len(rows))]), {}
    monkeypatch.setattr(ppo, "score", scores)
    rollout, _ = trained_rollout(monkeypatch, "test_flat_groups", adv_estimator="grpo", group_size=4, kl_in_loss=True)
    assert rollout.advantages[:4].abs().max() == 0 and rollout.advantages[4:].abs().max() > 0.1


def test_the_entropy_bonus_is_the_token_mean_entropy_at_the_temperature(world):
    # zero advantages and no critic: the only gradient is the bonus's, -c x grad of the mean entropy of
    # softmax(logits / tau) over valid tokens (here through the chunked head's written-out backward)
    policy, _, rollout, P = rollout_batch(world, B=16, T=T_HOT)
    rollout.advantages = torch.zeros_like(rollout.mask)
    ppo.minibatch_backward(policy, None, rollout, torch.arange(16), P, checked(ent_coef=0.1, temperature=T_HOT))
    got = {n: p.grad.clone() for n, p in policy.named_parameters()}
    policy.zero_grad()
    qr, am, mask = rollout.query_responses, rollout.attention_mask, rollout.mask
    logits = ppo.forward(policy, qr, am).logits[:, P - 1:-1].float() / T_HOT  # (B, T, V)
    logp = torch.log_softmax(logits, -1)
    entropy = -(logp.exp() * logp).sum(-1)  # (B, T)
    (-0.1 * (entropy * mask).sum() / mask.sum()).backward()
    for name, p in policy.named_parameters():
        assert_close_fp32(got[name], p.grad, 256, msg=name)
    assert max(p.grad.abs().max() for p in policy.parameters()) > 1e-4


@pytest.mark.parametrize("estimator", [None, "k2", "abs"])  # None: what check_args picks for the loss
@pytest.mark.parametrize("side", [-0.3, 0.3])
def test_kl_in_the_loss_pulls_the_policy_towards_the_reference(world, estimator, side):
    # zero advantages and no critic: the only gradient is beta x the KL estimate's, with the reference 0.3 nats
    # below (or above) the policy on every sampled token; a step down it must move the policy's log-probs of
    # those tokens towards the reference's. k1's gradient is grad log p whatever the reference: it lowers them
    # on both sides, and fails here.
    args = ppo.Args(kl_in_loss=True, kl_estimator=estimator)
    ppo.check_args(args, 1)
    policy, _, rollout, P = rollout_batch(world, B=16)
    mask = rollout.mask
    vars(rollout).update(ref_logprobs=rollout.logprobs + side * mask, kl_coef=1.0, advantages=torch.zeros_like(mask))
    ppo.minibatch_backward(policy, None, rollout, torch.arange(16), P, args)
    with torch.no_grad():
        for p in policy.parameters():
            p -= 1e-2 * p.grad
        after, _, _ = ppo.policy_logprobs(policy, rollout.query_responses, rollout.attention_mask, P, 0.7)
    assert np.sign(((after - rollout.logprobs) * mask).sum().item()) == np.sign(side)


@pytest.mark.parametrize("flags, message", [
    (dict(kl_in_loss=True, kl_estimator="k1"), "use k2 .*, k3 .* or abs"),
    (dict(adv_estimator="grpo", group_size=2, bootstrap_truncated=True, missing_eos_penalty=None), "need a critic"),
    (dict(adv_estimator="rloo", group_size=2, critic_lam=1.0), "need a critic"),
    (dict(adv_estimator="grpo", group_size=2, lam_alpha=0.05), "need a critic"),
    (dict(adv_estimator="rloo", group_size=2, gae_across_observations=False), "need a critic"),
    (dict(eval_greedy=True, eval_samples=4), "pass@k would be pass@1"),
    (dict(policy_loss="gspo", dual_clip=3.0), "--dual-clip is PPO's"),
    (dict(policy_loss="cispo", clip_eps=0.2), "--clip-eps.* do nothing"),
    (dict(policy_loss="cispo", clip_eps_high=0.28), "--clip-eps.* do nothing"),
])
def test_combinations_that_would_do_nothing_are_refused(flags, message):
    with pytest.raises(ppo.UsageError, match=message):
        ppo.check_args(ppo.Args(**flags), 1)


def test_the_defaults_resolved_per_estimator():
    gae, grpo, in_loss = ppo.Args(), ppo.Args(adv_estimator="grpo", group_size=2), ppo.Args(kl_in_loss=True)
    for a in (gae, grpo, in_loss):
        ppo.check_args(a, 1)
    assert (gae.whiten_advantages, grpo.whiten_advantages) == (True, False)
    assert (gae.kl_estimator, in_loss.kl_estimator) == ("k1", "k3")
    gspo, wider, cispo = (ppo.Args(policy_loss="gspo"), ppo.Args(policy_loss="gspo", clip_eps=1e-3),
                          ppo.Args(policy_loss="cispo"))
    for a in (gspo, wider, cispo):
        ppo.check_args(a, 1)
    assert (gae.clip_eps, gae.clip_eps_high, gae.loss_agg) == (0.2, None, "token-mean")
    assert (gspo.clip_eps, gspo.clip_eps_high, gspo.loss_agg) == (3e-4, 4e-4, "seq-mean-token-mean")  # the paper's
    assert (wider.clip_eps, wider.clip_eps_high) == (1e-3, 1e-3)  # a given --clip-eps: both bounds, as with ppo
    assert (cispo.clip_eps, cispo.clip_eps_high, cispo.cispo_cap) == (None, None, 5.0)


def test_each_prompts_group_sits_side_by_side_on_one_rank():
    args = ppo.Args(batch_size=16, group_size=4, seed=3)
    for update in (1, 2, 7):  # 7: the fourth pass over the 8 prompts
        rows = np.concatenate([ppo.prompt_order(update, 8, args, rank, 8) for rank in (0, 1)])  # (16,)
        groups = rows.reshape(-1, 4)
        assert (groups == groups[:, :1]).all() and len(set(groups[:, 0])) == 4  # 4 prompts, 4 samples each


@pytest.mark.parametrize("chunk", [0, 7])
def test_the_drawn_token_is_in_its_own_support(world, chunk):
    # the rollout pass recomputes the sampler's support from its own logits; in bf16 (or another batch shape)
    # a token the sampler drew at the boundary can fall outside it. Worst case here: the least likely token.
    policy_path, _ = world
    policy = AutoModelForCausalLM.from_pretrained(policy_path).eval()
    tok = AutoTokenizer.from_pretrained(policy_path, padding_side="left")
    enc = tok(toy.prompts(4, seed=0), return_tensors="pt", padding=True)
    P, T = enc.input_ids.shape[1], 3
    qr, am = enc.input_ids, enc.attention_mask
    with torch.no_grad():
        for _ in range(T):
            last = ppo.forward(policy, qr, am).logits[:, -1]  # (B, V)
            qr, am = torch.cat([qr, last.argmin(-1, keepdim=True)], 1), torch.cat([am, am[:, -1:]], 1)
        logprobs, _, keep = ppo.policy_logprobs(policy, qr, am, P, T_HOT, sampler_filter=(2, 1.0), chunk=chunk)
    assert torch.isfinite(logprobs).all()
    support = ppo.dense_support(keep, 4 * T, policy.config.vocab_size).view(4, T, -1)  # (B, T, V)
    assert (support.sum(-1) == 3).all()  # the two top-k tokens and the drawn one
    assert support.gather(-1, qr[:, P:, None]).all()


def test_the_dual_clip_counts_in_the_clip_fraction():
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[5.0, 1.1, 5.0]])).requires_grad_()  # a ratio of 5 with A < 0: capped
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    losses, _, _, clipped = ppo.policy_loss(new, old, adv, 0.2, dual_clip=3.0)
    losses.sum().backward()
    assert clipped.tolist() == [[1.0, 0.0, 1.0]] and (new.grad[0] == 0).tolist() == [True, False, True]


def test_reward_model_scoring_keeps_the_token_budget(world):
    _, _, rollout, P = rollout_batch(world, B=16)
    seq_cls = AutoModelForSequenceClassification.from_pretrained(world[1]).eval()
    shapes = []  # (rows, tokens) of each forward of the reward model's backbone
    getattr(seq_cls, seq_cls.base_model_prefix).register_forward_pre_hook(
        lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    args = (ppo.ValueModel(seq_cls), None, rollout.query_responses, rollout.attention_mask, rollout.lengths,
            P, None, 16)
    with torch.no_grad():
        whole = ppo.reward_model_scores(*args)
        shapes.clear()
        packed = ppo.reward_model_scores(*args, budget=60)
    assert len(shapes) > 2 and all(b == 1 or b * n <= 60 for b, n in shapes)
    assert_close_fp32(packed, whole, 256)


def test_pass_at_k_is_the_share_of_k_subsets_with_a_pass():
    """The estimator against its definition, brute force: of all k-subsets of n samples (c of them right),
    the share that hold at least one right one."""
    import itertools
    for n in range(1, 8):
        for c in range(n + 1):
            right = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(right, k))
                brute = sum(any(s) for s in subsets) / len(subsets)
                assert abs(ppo.pass_at_k(n, c, k) - brute) < 1e-9, (n, c, k)
