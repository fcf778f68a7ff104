"""The pieces of ppo.py on hand-made tensors and on the real toy models."""
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import ppo
from fp32 import assert_close_fp32, logprob_tolerance

pytestmark = pytest.mark.fast
EOS, PAD = 1, 0
T_HOT = 1.3  # not the default 0.7: a pass that ignores --temperature must show


def test_lengths_mask_and_reward_on_eos():
    responses = torch.tensor([[7, 8, EOS, PAD, PAD],   # [t0, t1, eos, pad, pad]
                              [7, 8, 9, 10, 11],       # no EOS: cut by the length limit
                              [EOS, 5, EOS, 6, 7]])    # only the first EOS counts
    lengths = ppo.response_lengths(responses, EOS)
    assert lengths.tolist() == [3, 5, 1]
    mask = (torch.arange(5) < lengths[:, None]).float()
    kl = torch.full((3, 5), 0.5) * mask
    rewards, non_score = ppo.per_token_rewards(kl, torch.tensor([2.0, -1.0, 3.0]), lengths, kl_coef=0.1)
    torch.testing.assert_close(rewards[0], torch.tensor([-0.05, -0.05, 1.95, 0.0, 0.0]))  # score on the EOS
    torch.testing.assert_close(rewards[1], torch.tensor([-0.05, -0.05, -0.05, -0.05, -1.05]))  # on the last token
    torch.testing.assert_close(rewards[2], torch.tensor([2.95, 0.0, 0.0, 0.0, 0.0]))
    assert (non_score * (1 - mask) == 0).all()


def test_kl_estimators_on_known_values():
    logp = torch.log(torch.tensor([0.5, 0.25]))
    ref = torch.log(torch.tensor([0.25, 0.5]))
    torch.testing.assert_close(ppo.kl_penalty(logp, ref, "k1"), torch.tensor([math.log(2), -math.log(2)]))
    # k3 = (r - 1) - log r with r = p_ref / p: r = 0.5 -> 0.5 - 1 + log 2; r = 2 -> 1 - log 2
    torch.testing.assert_close(ppo.kl_penalty(logp, ref, "k3"),
                               torch.tensor([math.log(2) - 0.5, 1 - math.log(2)]))
    assert ppo.kl_penalty(ref, ref, "k3").abs().max() == 0


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_policy_clip_zeroes_the_gradient_on_the_right_side(sign):
    old = torch.zeros(1, 4)
    # ratios 0.5, 0.9, 1.1, 1.5 with eps 0.2: the first and last lie outside the clip range
    new = torch.log(torch.tensor([[0.5, 0.9, 1.1, 1.5]])).requires_grad_()
    adv = torch.full((1, 4), sign)
    losses, ratio, _, clipped = ppo.policy_loss(new, old, adv, clip_eps=0.2)
    losses.sum().backward()
    g = new.grad[0]
    assert g[1] != 0 and g[2] != 0  # inside the range: always a gradient
    if sign > 0:  # A > 0: pushing the ratio up is capped at 1 + eps, pushing it up from below is not
        assert g[3] == 0 and g[0] != 0
        assert clipped[0].tolist() == [0, 0, 0, 1]
    else:  # A < 0: pushing the ratio down is capped at 1 - eps
        assert g[0] == 0 and g[3] != 0
        assert clipped[0].tolist() == [1, 0, 0, 0]


def test_value_clip_is_anchored_on_rollout_values():
    old = torch.tensor([[0.0, 0.0]])
    returns = torch.tensor([[1.0, 1.0]])
    new = torch.tensor([[0.5, 0.1]], requires_grad=True)  # the first moved 0.5 from the rollout value
    losses, clipped = ppo.value_loss(new, old, returns, value_clip_eps=0.2)
    loss = losses.sum()
    loss.backward()
    # first: clipped value 0.2 has the larger error (0.64 > 0.25): the max takes it and its gradient is 0
    assert clipped[0].tolist() == [1.0, 0.0]
    assert new.grad[0, 0] == 0 and new.grad[0, 1] != 0
    torch.testing.assert_close(loss, 0.5 * torch.tensor(0.64 + 0.81))
    losses_off, clipped_off = ppo.value_loss(new, old, returns, value_clip_eps=None)
    torch.testing.assert_close(losses_off.sum(), 0.5 * torch.tensor(0.25 + 0.81))
    assert clipped_off.sum() == 0


def test_clip_fractions_count_only_where_the_clip_binds():
    # old -0.3, new -0.12, return 0, eps 0.2: new is inside the band, but old + (new - old) rounds to
    # -0.12000000477 in float32, whose error is one ulp larger than new's; that is not clipping
    losses, clipped = ppo.value_loss(torch.tensor([-0.12]), torch.tensor([-0.3]), torch.tensor([0.0]), 0.2)
    assert clipped.item() == 0 and losses.item() == pytest.approx(0.5 * 0.12 ** 2)
    # critic values as a real run moves them, against the fractions computed in float64
    g = torch.Generator().manual_seed(0)
    old = torch.randn(100_000, generator=g) * 0.1
    new = old + torch.randn(100_000, generator=g) * 0.05 + torch.randn(100_000, generator=g) * 0.05
    returns = torch.randn(100_000, generator=g) * 0.3
    _, clipped = ppo.value_loss(new, old, returns, 0.2)
    o, n, r = old.double(), new.double(), returns.double()
    truth = ((n - o).abs() > 0.2) & ((o + (n - o).clamp(-0.2, 0.2) - r) ** 2 > (n - r) ** 2)
    assert clipped.bool().tolist() == truth.tolist() and truth.any()
    # the policy's: clamp returns a ratio inside the range unchanged, so the flag is exact there too
    adv = torch.randn(100_000, generator=g)
    logratio = torch.randn(100_000, generator=g) * 0.15
    _, _, _, clipped = ppo.policy_loss(logratio, torch.zeros(100_000), adv, clip_eps=0.2)
    ratio = logratio.exp().double()
    truth = ((adv > 0) & (ratio > 1.2)) | ((adv < 0) & (ratio < 0.8))
    assert clipped.bool().tolist() == truth.tolist() and truth.any()


def test_masked_whiten_ignores_padding():
    x = torch.tensor([[1.0, 2.0, 3.0, 50.0], [4.0, 5.0, -40.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    w = ppo.masked_whiten(x, mask)
    valid = w[mask.bool()]
    assert abs(valid.mean()) < 1e-6 and abs(valid.std() - 1) < 1e-4
    assert (w[~mask.bool()] == 0).all()
    kept = ppo.masked_whiten(x, mask, shift_mean=False)
    assert abs(kept[mask.bool()].mean() - 3.0) < 1e-5  # mean of the valid entries survives


def test_disable_dropout_makes_forward_deterministic(world):
    policy_path, _ = world
    model = AutoModelForCausalLM.from_pretrained(policy_path, attention_dropout=0.5).train()
    x = torch.randint(4, 40, (2, 8))
    assert not torch.equal(model(x).logits, model(x).logits)  # dropout really is on
    ppo.disable_dropout(model).train()
    assert torch.equal(model(x).logits, model(x).logits)


def checked(**flags):
    """Args with the defaults that check_args resolves (--clip-eps, --loss-agg...), as main sees them."""
    args = ppo.Args(**flags)
    ppo.check_args(args, 1)
    return args


def rollout_batch(world, B=32, T=0.7, seed=0):
    """A real rollout from the toy policy at temperature T, laid out as ppo.main lays it out."""
    import toy
    policy_path, reward_path = world
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(policy_path, padding_side="left")
    policy = ppo.disable_dropout(AutoModelForCausalLM.from_pretrained(policy_path))
    critic = ppo.ValueModel(ppo.disable_dropout(AutoModelForSequenceClassification.from_pretrained(reward_path)))
    enc = tok(toy.prompts(B, seed=seed), return_tensors="pt", padding=True)
    P = enc.input_ids.shape[1]
    with torch.no_grad():
        out = policy.generate(**enc, do_sample=True, temperature=T, top_k=0, top_p=1.0, max_new_tokens=12,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    responses = out[:, P:]
    lengths = ppo.response_lengths(responses, tok.eos_token_id)
    Tr = int(lengths.max())
    mask = (torch.arange(Tr) < lengths[:, None]).float()
    responses = responses[:, :Tr].masked_fill(mask == 0, tok.pad_token_id)
    qr = torch.cat([enc.input_ids, responses], 1)
    am = torch.cat([enc.attention_mask, mask.long()], 1)
    with torch.no_grad():
        logprobs, _, _ = ppo.policy_logprobs(policy, qr, am, P, T)
        values = ppo.state_values(critic, qr, am, P)[:, :Tr] * mask
    g = torch.Generator().manual_seed(seed)
    rollout = SimpleNamespace(  # the fields of ppo.Rollout that minibatch_backward reads
        query_responses=qr, attention_mask=am, lengths=lengths, mask=mask, logprobs=logprobs, values=values,
        advantages=torch.randn(B, Tr, generator=g) * mask, returns=torch.randn(B, Tr, generator=g) * mask)
    return policy, critic, rollout, P


def test_ratio_is_one_on_a_real_rollout(world):
    # sampled and scored at T 1.3 (tests/test_oracles.py checks those log-probs against each row alone);
    # the training pass, on other micro-batches in another order, must find the same log-probs
    policy, critic, rollout, P = rollout_batch(world, T=T_HOT)
    assert (rollout.lengths > 1).any() and (rollout.lengths < rollout.mask.shape[1]).any()
    args = checked(micro_batch_size=8, temperature=T_HOT)
    stats = ppo.minibatch_backward(policy, critic, rollout, torch.randperm(32), P, args)
    tol = logprob_tolerance(policy, T_HOT)  # two orders of fp32 sums: 1.3e-4 here; a temperature left out gives 0.1
    assert stats["ratio_dev_max"] < math.expm1(tol) and stats["ratio_dev"] / stats["tokens"] < math.expm1(tol)
    assert stats["approxkl"] / stats["tokens"] <= tol ** 2 / 2  # (1/2 (log ratio)^2)
    assert abs(stats["ratio"] / stats["tokens"] - 1) < math.expm1(tol)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-sum-norm"])
def test_micro_batches_leave_the_gradient_unchanged(world, loss_agg):
    grads = []  # one micro-batch; 2 and 4 of rows in order; packed by token budgets (sorted by length)
    for split in (dict(micro_batch_size=32), dict(micro_batch_size=16), dict(micro_batch_size=8),
                  dict(micro_batch_tokens=60), dict(micro_batch_tokens=150)):
        policy, critic, rollout, P = rollout_batch(world)
        args = checked(**split, ent_coef=0.01, loss_agg=loss_agg, response_length=12)
        ppo.minibatch_backward(policy, critic, rollout, torch.arange(32), P, args)
        grads.append({f"{m}.{n}": p.grad for m, model in (("policy", policy), ("critic", critic))
                      for n, p in model.named_parameters()})
    assert max(g.abs().max() for g in grads[0].values()) > 0
    for g in grads[1:]:  # the minibatch's tokens summed in other groups: fp32's rounding of a sum that long
        for name in g:
            assert_close_fp32(g[name], grads[0][name], int(rollout.mask.sum()), msg=name)


def test_gradient_checkpointing_leaves_the_gradient_unchanged(world):
    grads = []
    for checkpointing in (False, True):
        policy, critic, rollout, P = rollout_batch(world, B=16)
        if checkpointing:
            for m in (policy, critic.seq_cls):
                m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                m.train()  # HF recomputes only in training mode, as ppo.main sets it for phase 7
        ppo.minibatch_backward(policy, critic, rollout, torch.arange(16), P, checked(micro_batch_size=8))
        grads.append(torch.cat([p.grad.flatten() for p in list(policy.parameters()) + list(critic.parameters())]))
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=0)
    assert policy.model.gradient_checkpointing and grads[0].abs().max() > 0


def test_token_budget_micro_batches_cover_every_row_within_the_budget():
    lengths = torch.tensor([8, 256, 40, 9, 130, 12, 256, 70, 8, 33])
    batches = ppo.micro_batches(lengths, P=10, rows=4, budget=300)
    assert sorted(torch.cat(batches).tolist()) == list(range(10))  # every row once
    for b in batches:  # rows x (prompt + longest response) within the budget (a single row always fits)
        assert len(b) == 1 or len(b) * (10 + int(lengths[b].max())) <= 300
    assert len(batches) < len(ppo.micro_batches(lengths, P=10, rows=1))  # short rows share a micro-batch
    assert [len(b) for b in ppo.micro_batches(lengths, P=10, rows=4)] == [4, 4, 2]  # without a budget: in order


def test_rollout_passes_are_the_same_with_a_token_budget(world):
    policy, critic, rollout, P = rollout_batch(world)
    args = (policy, policy, critic, rollout.query_responses, rollout.attention_mask, rollout.mask, P, 32, 0.7)
    plain, packed = ppo.rollout_passes(*args), ppo.rollout_passes(*args, budget=60)
    mask = rollout.mask  # (what lies on padding depends on the micro-batch's trim, and is never read)
    for a, b in zip(plain[:4], packed[:4]):  # other batch shapes: fp32's rounding of the toy's longest sum
        assert_close_fp32(b * mask, a * mask, 256)
    assert_close_fp32(packed[4], plain[4], 256)  # the values after the last token
