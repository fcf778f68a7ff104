"""Record veRL 0.9.1's rollout corrections as a fixture: tests/verl_rollout_corr.json.

TEST-ONLY, like tests/verl_oracle.py (same environment, same reproduction steps; run
`python tests/verl_rollout_corr.py` from the repo root). For each of ppo.py's --rollout-correction
modes it calls veRL's compute_rollout_correction_and_rejection_mask at the setting that mode claims
to equal, on the mode's default bounds, and records the IS weights, the modified response mask and
veRL's metrics; then veRL's vanilla PPO loss with those weights and that mask (as its actor uses
them), its value and d loss / d log_prob, for token-mean and seq-mean-token-mean.

Inputs: float32 draws from a seeded generator, widened to float64 (veRL runs in float64). Rows: right
padding, one multi-turn row with a hole in its mask (observation tokens, whose log-probs are set
wild so that a correction that read them would show), one empty row. The sampler's log-probs are the
trainer's plus noise of a per-mode scale chosen so that each mode's bounds bind on some rows and not on others.
"""
import datetime, json, math, os
import torch
import verl
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask
from verl.workers.config import ActorConfig

B, T = 7, 12
LENGTHS = [12, 7, 1, 5, 9]          # rows 0-4: right-padded; row 5: hole; row 6: empty
HOLE_ROW, EMPTY_ROW = 5, 6
MODES = {  # ppo.py's mode -> (veRL kwargs at ppo.py's default bounds, sampler noise sd)
    "token-is": (dict(rollout_is="token", rollout_is_threshold=2.0), 0.8),
    "seq-is": (dict(rollout_is="sequence", rollout_is_threshold=2.0), 0.3),
    "icepop": (dict(rollout_is="token", rollout_is_threshold="0.5_5.0"), 1.0),
    "token-mask": (dict(rollout_is=None, rollout_rs="token_k1", rollout_rs_threshold=f"{1 / 3!r}_3.0"), 0.6),
    "seq-mask": (dict(rollout_is=None, rollout_rs="seq_sum_k1", rollout_rs_threshold=f"{1 / 3!r}_3.0"), 0.4),
    "geo-mask": (dict(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"), 3e-3),
}
CLIP = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)

g = torch.Generator().manual_seed(5)
f32 = dict(generator=g, dtype=torch.float32)
mask = torch.zeros(B, T, dtype=torch.bool)
for r, n in enumerate(LENGTHS):
    mask[r, :n] = True
mask[HOLE_ROW, 0:4] = mask[HOLE_ROW, 7:10] = True     # multi-turn: tokens 0-3 and 7-9
old32 = -(0.1 + 2.9 * torch.rand(B, T, **f32))
adv32 = torch.randn(B, T, **f32)
new32 = old32 + 0.3 * torch.randn(B, T, **f32)
sampler32 = {k: old32 + sd * torch.randn(B, T, **f32) for k, (_, sd) in MODES.items()}
for v in sampler32.values():  # the observation tokens of the hole row: off the policy, wild values
    v[HOLE_ROW, 4:7] = old32[HOLE_ROW, 4:7] + 30.0
old, adv, new = old32.double(), adv32.double(), new32.double()
sampler = {k: v.double() for k, v in sampler32.items()}


def loss_and_grad(weights, kept, agg):
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, loss_agg_mode=agg, **CLIP)
    cfg.global_batch_info.update(dict(dp_size=1, batch_num_tokens=None, global_batch_size=None,
                                      loss_scale_factor=None))
    x = new.clone().requires_grad_(True)
    loss, _ = core_algos.compute_policy_loss_vanilla(old_log_prob=old, log_prob=x, advantages=adv, response_mask=kept,
                                                      loss_agg_mode=agg, config=cfg, rollout_is_weights=weights)
    loss.backward()
    assert math.isfinite(loss.item()) and x.grad.isfinite().all() and (x.grad[~kept] == 0).all()
    return loss.item(), x.grad.tolist()


cases = []
for name, (kw, _) in MODES.items():
    proto, kept, metrics = compute_rollout_correction_and_rejection_mask(
        old_log_prob=old, rollout_log_prob=sampler[name], response_mask=mask, **kw)
    weights = None if proto is None else proto.batch["rollout_is_weights"]
    assert kept.dtype == torch.bool and not (kept & ~mask).any()  # never a token outside the mask
    acted = (kept != mask).any() if weights is None else (weights != torch.exp(
        (old - sampler[name]).sum(-1, keepdim=True) * mask if name == "seq-is" else (old - sampler[name])) * mask).any()
    valid = mask.any(-1)
    changed_rows = (kept != mask).any(-1) if weights is None else None
    assert acted, name  # each mode's bounds bind somewhere ...
    if changed_rows is not None:
        assert (valid & ~changed_rows).any(), name  # ... and not everywhere
    case = dict(mode=name, verl_kwargs=kw, is_weights=None if weights is None else weights.tolist(),
                kept=kept.int().tolist(), metrics=metrics)
    for agg in ("token-mean", "seq-mean-token-mean"):
        case[agg] = dict(zip(("loss", "grad_log_prob"), loss_and_grad(weights, kept, agg)))
    cases.append(case)

fixture = dict(
    about="veRL 0.9.1 rollout corrections on fixed inputs; regenerate with tests/verl_rollout_corr.py",
    verl_version=verl.__version__, torch_version=torch.__version__, date=datetime.date.today().isoformat(),
    B=B, T=T, clip=CLIP, rows=dict(hole=HOLE_ROW, hole_tokens=[0, 1, 2, 3, 7, 8, 9], empty=EMPTY_ROW),
    noise_sd={k: v[1] for k, v in MODES.items()},
    inputs=dict(response_mask=mask.int().tolist(), old_log_prob=old.tolist(), log_prob=new.tolist(),
                advantages=adv.tolist(), rollout_log_prob={k: v.tolist() for k, v in sampler.items()}),
    cases=cases)
path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verl_rollout_corr.json")
with open(path, "w") as f:  # one line per top-level key and per case
    f.write("{\n" + ",\n".join(f"{json.dumps(k)}: " + ("[\n" + ",\n".join(json.dumps(c) for c in v) + "\n]"
                                                       if k == "cases" else json.dumps(v))
                               for k, v in fixture.items()) + "\n}\n")
for c in cases:
    kept = torch.tensor(c["kept"])
    print(f"{c['mode']:11s} kept {int(kept.sum())}/{int(mask.sum())} tokens, "
          f"token-mean loss {c['token-mean']['loss']!r}, seq-mean-token-mean {c['seq-mean-token-mean']['loss']!r}")
print("wrote", path, os.path.getsize(path), "bytes")
