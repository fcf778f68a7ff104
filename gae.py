"""Generalized Advantage Estimation (Schulman et al. 2016) as the textbook backward scan.

    delta_t = r_t + gamma * V_{t+1} - V_t
    A_t     = delta_t + gamma * lam * A_{t+1}
    R_t     = A_t + V_t                        (the critic's regression target)

Shapes: B rollouts, T response tokens. `mask` is 1 on valid response tokens, a prefix of each row
(multi-turn episodes, whose observations leave holes in it: `compute_gae_over_actions`).
Past the last valid token the episode is over: V_{t+1} is 0 there (terminal, the response ended
with EOS) or `bootstrap_value` (truncated by the length limit: the state is not terminal, so its
estimated value stands in for the rewards that were never sampled). No whitening here: the trainer
does that behind a flag, so it can be ablated.
"""
import torch


def compute_gae(rewards, values, mask, gamma=1.0, lam=0.95, bootstrap_value=None):
    """rewards, values, mask: (B, T) float; lam: a float, (B,) or (B, T) (lam_t weighs A_{t+1} in A_t);
    bootstrap_value: (B,) or None. Returns advantages, returns: (B, T), both 0 on padding."""
    B, T = rewards.shape
    mask = mask.to(rewards.dtype)
    lam = torch.as_tensor(lam, dtype=rewards.dtype, device=rewards.device)
    lam = (lam[:, None] if lam.dim() == 1 else lam).expand(B, T)  # (B, T)
    # value of the state after the last valid token: V_T where the row fills the window
    nextvalues = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)  # (B,)
    if bootstrap_value is not None:
        nextvalues = bootstrap_value.to(rewards.dtype)
    lastgaelam = torch.zeros_like(nextvalues)  # (B,)
    advantages = torch.zeros_like(rewards)  # (B, T)
    for t in reversed(range(T)):
        valid = mask[:, t]  # (B,)
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]  # (B,)
        lastgaelam = (delta + gamma * lam[:, t] * lastgaelam) * valid  # (B,): 0 on padding
        advantages[:, t] = lastgaelam
        # on padding keep carrying the bootstrap value back to the last valid token;
        # on valid tokens V_t becomes the next step's V_{t+1}
        nextvalues = torch.where(valid.bool(), values[:, t], nextvalues)  # (B,)
    returns = (advantages + values) * mask  # (B, T)
    return advantages, returns


def compute_gae_over_actions(rewards, values, mask, gamma=1.0, lam=0.95, bootstrap_value=None):
    """GAE over the agent's tokens of multi-turn episodes, where `mask` (the action mask) has holes: the
    observations between turns. Each row's agent tokens are moved to the front in order (a prefix), scanned
    by `compute_gae`, and put back: the value after a turn's last token is the value at the next turn's
    first agent token, the running advantage carries over the observations, and gamma counts agent
    tokens only (veRL skips observation positions; RL2 compacts like this). With a prefix mask (one turn)
    the moves are the identity. Returns advantages, returns: (B, T), 0 off the agent's tokens."""
    order = torch.sort((mask == 0).to(torch.uint8), dim=1, stable=True).indices  # (B, T): agent tokens first
    if torch.is_tensor(lam) and lam.dim() == 2:  # (B, T): a lambda for each token, moved with it
        lam = lam.gather(1, order)
    advantages, returns = compute_gae(rewards.gather(1, order), values.gather(1, order), mask.gather(1, order),
                                      gamma, lam, bootstrap_value)  # (B, T) each, compacted
    return (torch.zeros_like(advantages).scatter(1, order, advantages),
            torch.zeros_like(returns).scatter(1, order, returns))  # (B, T) each, back in place
