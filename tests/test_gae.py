import pytest
import torch

from gae import compute_gae

pytestmark = pytest.mark.fast


def test_worked_example():
    # gamma 0.9, lam 0.8, terminal reward 1 on the last token (shared/reading/001, section 6)
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 0.35, 0.55, 0.8]])
    adv, ret = compute_gae(rewards, values, torch.ones(1, 4), gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.382, 0.371, 0.314, 0.200]]), atol=5e-4, rtol=0)
    torch.testing.assert_close(ret, adv + values)


def test_lambda_zero_is_td_residual_and_one_is_return_minus_value():
    g = torch.Generator().manual_seed(0)
    r, v = torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)
    mask = torch.ones(3, 6)
    adv0, _ = compute_gae(r, v, mask, gamma=0.9, lam=0.0)
    next_v = torch.cat([v[:, 1:], torch.zeros(3, 1)], 1)
    torch.testing.assert_close(adv0, r + 0.9 * next_v - v)
    adv1, _ = compute_gae(r, v, mask, gamma=0.9, lam=1.0)
    discounts = 0.9 ** torch.arange(6.0)
    mc_return = torch.stack([(r[:, t:] * discounts[: 6 - t]).sum(1) for t in range(6)], 1)
    torch.testing.assert_close(adv1, mc_return - v)


def test_padding_values_do_not_leak():
    rewards = torch.tensor([[0.1, -0.2, 1.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0]])  # [t0, t1, eos, pad, pad]
    values = torch.tensor([[0.3, 0.1, 0.4, 0.0, 0.0]])
    poisoned = values.clone()
    poisoned[0, 3:] = 100.0  # garbage at padded slots, as a critic may well produce there
    a, r = compute_gae(rewards, values, mask)
    b, s = compute_gae(rewards, poisoned, mask)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(r, s)
    assert (a[0, 3:] == 0).all() and (r[0, 3:] == 0).all()


def test_truncation_bootstrap():
    rewards, values, mask = torch.zeros(1, 3), torch.tensor([[0.5, 0.6, 0.7]]), torch.ones(1, 3)
    adv, ret = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0, bootstrap_value=torch.tensor([2.0]))
    torch.testing.assert_close(ret, torch.full((1, 3), 2.0))  # the cut state's value flows back
    adv_t, _ = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv - adv_t, torch.full((1, 3), 2.0))


def test_matches_brute_force_double_sum():
    g = torch.Generator().manual_seed(1)
    B, T, gamma, lam = 5, 7, 0.95, 0.9
    rewards, values = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T) < lengths[:, None]).float()
    boot = torch.randn(B, generator=g)
    adv, ret = compute_gae(rewards, values, mask, gamma, lam, bootstrap_value=boot)
    expected = torch.zeros(B, T)
    for b in range(B):
        n = int(lengths[b])
        v = torch.cat([values[b, :n], boot[b:b + 1]])  # V_0..V_{n-1}, then the bootstrap
        delta = rewards[b, :n] + gamma * v[1:] - v[:-1]
        for t in range(n):
            expected[b, t] = sum((gamma * lam) ** (k - t) * delta[k] for k in range(t, n))
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, (expected + values) * mask)
