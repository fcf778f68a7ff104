"""Record veRL 0.9.1's policy objectives as a fixture: tests/verl_objectives.json.

TEST-ONLY. veRL is not a requirement of this project; this script only regenerates
the recorded numbers that the tests compare ppo.py against, so that the oracle for
PPO (dual clip), GSPO and CISPO is somebody else's code, not a hand derivation.

For every case it records veRL's loss, d loss / d log_prob (B x T, float64), and the
pg_clipfrac / pg_clipfrac_lower metrics, on fixed inputs (float32 draws from a seeded
torch.Generator, widened to float64, so they are exact in both; veRL runs in float64).
The mask is passed as bool, as veRL's trainer does (workers/utils/losses.ppo_loss).

Reproduce from scratch (CPU is enough; add --index-url https://download.pytorch.org/whl/cpu
to the torch install for the small CPU wheel):
    python -m venv v && . v/bin/activate
    pip install torch==2.13.0 numpy
    pip install --no-deps verl==0.9.1
    pip install ray tensordict omegaconf transformers codetiming orjson
    python tests/verl_oracle.py            # from the repo root; writes tests/verl_objectives.json
(Those six are what `import verl.trainer.ppo.core_algos` needs; recorded with ray 2.60.0,
tensordict 0.15.3, omegaconf 2.4.0, transformers 5.19.0, codetiming 1.4.0, orjson 3.13.0.)
"""
import datetime, json, math, os
import torch
import verl
from verl.trainer.ppo import core_algos
from verl.workers.config import ActorConfig

B, T = 7, 12
LENGTHS = [12, 7, 1, 5, 9]          # rows 0-4: right-padded; row 5: hole; row 6: empty
HOLE_ROW, EMPTY_ROW = 5, 6
DUAL_CLIP_TOKEN = (0, 3)            # forced: A < 0 and ratio = e^1.5 > clip_ratio_c = 3
OBJECTIVES = {  # name -> (veRL function, ActorConfig clip kwargs, log-ratio noise sd)
    "vanilla": ("compute_policy_loss_vanilla", dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0), 0.4),
    "gspo": ("compute_policy_loss_gspo", dict(clip_ratio_low=3e-4, clip_ratio_high=4e-4), 1e-3),
    "cispo": ("compute_policy_loss_cispo", dict(clip_ratio_low=1.0, clip_ratio_high=4.0), 1.0),
}
MODES = {"vanilla": ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"],
         "gspo": ["seq-mean-token-mean"],
         "cispo": ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]}

g = torch.Generator().manual_seed(3)
f32 = dict(generator=g, dtype=torch.float32)
mask = torch.zeros(B, T, dtype=torch.bool)
for r, n in enumerate(LENGTHS):
    mask[r, :n] = True
mask[HOLE_ROW, 0:4] = mask[HOLE_ROW, 7:10] = True     # multi-turn: tokens 0-3 and 7-9
old32 = -(0.1 + 2.9 * torch.rand(B, T, **f32))
adv32 = torch.randn(B, T, **f32)
isw32 = 0.5 + 1.5 * torch.rand(B, T, **f32)
lp32 = {k: old32 + sd * torch.randn(B, T, **f32) for k, (_, _, sd) in OBJECTIVES.items()}
adv32[DUAL_CLIP_TOKEN] = -adv32[DUAL_CLIP_TOKEN].abs()
lp32["vanilla"][DUAL_CLIP_TOKEN] = old32[DUAL_CLIP_TOKEN] + 1.5
old, adv, isw = old32.double(), adv32.double(), isw32.double()
lp = {k: v.double() for k, v in lp32.items()}
valid_rows = mask.any(-1)


def run(obj, mode, use_isw, batch_info):
    fn_name, clip, _ = OBJECTIVES[obj]
    lsf = T if mode == "seq-mean-token-sum-norm" else None
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                      loss_agg_mode=mode, loss_scale_factor=lsf, **clip)
    # exactly what workers/utils/losses.ppo_loss puts there before calling the policy loss
    cfg.global_batch_info.update({**dict(dp_size=1, batch_num_tokens=None, global_batch_size=None,
                                         loss_scale_factor=cfg.loss_scale_factor), **batch_info})
    x = lp[obj].clone().requires_grad_(True)
    loss, metrics = getattr(core_algos, fn_name)(
        old_log_prob=old, log_prob=x, advantages=adv, response_mask=mask, loss_agg_mode=mode,
        config=cfg, rollout_is_weights=isw if use_isw else None)
    loss.backward()
    grad = x.grad
    assert loss.dtype == torch.float64 and math.isfinite(loss.item()) and grad.isfinite().all()
    assert (grad[~mask] == 0).all() and (grad[EMPTY_ROW] == 0).all(), "masked tokens must get no gradient"
    return dict(objective=obj, mode=mode, verl_function=fn_name, clip=clip, loss_scale_factor=lsf,
                rollout_is_weights=use_isw, global_batch_info=dict(cfg.global_batch_info),
                loss=loss.item(), pg_clipfrac=metrics["actor/pg_clipfrac"],
                pg_clipfrac_lower=metrics["actor/pg_clipfrac_lower"], grad_log_prob=grad.tolist())


# --- the inputs really cross the clip boundaries ---
ratio = {k: torch.exp(v - old) for k, v in lp.items()}
rv = ratio["vanilla"]
assert (mask & (adv > 0) & (rv > 1.28)).any() and (mask & (adv < 0) & (rv < 0.8)).any()
assert (mask & (adv < 0) & (rv > 3.0)).any()
s = torch.exp(((lp["gspo"] - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1))[valid_rows]
out = (s < 1 - 3e-4) | (s > 1 + 4e-4)
assert out.any() and (~out).any() and (s < 1 - 3e-4).any() and (s > 1 + 4e-4).any(), s
assert (mask & (ratio["cispo"] > 5.0)).sum() >= 2

cases, trainer_cases = [], []
for obj in OBJECTIVES:
    for i, mode in enumerate(MODES[obj]):
        cases.append(run(obj, mode, False, {}))
        if i == 0:
            cases.append(run(obj, mode, True, {}))
        if mode.startswith("seq-mean"):  # veRL's trainer passes global_batch_size = mini-batch rows (empty ones too)
            trainer_cases.append(run(obj, mode, False, dict(batch_num_tokens=int(mask.sum()), global_batch_size=B)))

# --- checks on veRL's own outputs ---
van = cases[0]
assert van["pg_clipfrac"] > 0 and van["pg_clipfrac_lower"] > 0
assert van["grad_log_prob"][DUAL_CLIP_TOKEN[0]][DUAL_CLIP_TOKEN[1]] == 0.0  # dual clip: constant -3A
assert 0 < cases[4]["pg_clipfrac"] < 1                                       # GSPO: some clipped, some not
cis = next(c for c in cases if c["objective"] == "cispo")                   # token-mean, no IS weights
capped = mask & (ratio["cispo"] > 5.0)
assert torch.allclose(torch.tensor(cis["grad_log_prob"], dtype=torch.float64)[capped], -5.0 * adv[capped] / mask.sum(), rtol=1e-12)
# a float mask instead of bool changes seq-mean-token-mean only through veRL's +1e-8 (bool: int+1e-8 -> float32)
lf = core_algos.agg_loss(adv, mask.double(), "seq-mean-token-mean")
lb = core_algos.agg_loss(adv, mask, "seq-mean-token-mean")
assert lf != lb and abs(lf - lb) < 1e-7 * abs(lb)

fixture = dict(
    about="veRL 0.9.1 policy objectives on fixed inputs; regenerate with tests/verl_oracle.py",
    verl_version=verl.__version__, torch_version=torch.__version__, date=datetime.date.today().isoformat(),
    B=B, T=T, rows=dict(right_padded={str(r): n for r, n in enumerate(LENGTHS)}, hole=HOLE_ROW,
                        hole_tokens=[0, 1, 2, 3, 7, 8, 9], empty=EMPTY_ROW, dual_clip_token=list(DUAL_CLIP_TOKEN)),
    log_ratio_noise_sd={k: v[2] for k, v in OBJECTIVES.items()},
    inputs=dict(response_mask=mask.int().tolist(), old_log_prob=old.tolist(), advantages=adv.tolist(),
                rollout_is_weights=isw.tolist(), log_prob={k: v.tolist() for k, v in lp.items()}),
    cases=cases, cases_trainer_batch_info=trainer_cases)
path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verl_objectives.json")
with open(path, "w") as f:  # one line per top-level key and per case
    f.write("{\n" + ",\n".join(
        f"{json.dumps(k)}: " + ("[\n" + ",\n".join(json.dumps(c) for c in v) + "\n]" if k.startswith("cases")
                                else json.dumps(v)) for k, v in fixture.items()) + "\n}\n")
for c in cases + trainer_cases:
    print(f"{c['objective']:8s} {c['mode']:24s} isw={c['rollout_is_weights']!s:5s} "
          f"gbs={c['global_batch_info']['global_batch_size']!s:4s} loss={c['loss']!r} "
          f"clipfrac={c['pg_clipfrac']:.4f} lower={c['pg_clipfrac_lower']:.4f}")
print("wrote", path, os.path.getsize(path), "bytes")
