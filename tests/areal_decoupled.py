"""Record AReaL's decoupled PPO actor loss (Fu et al. 2025, arXiv 2505.24298) as a fixture: tests/areal_decoupled.json.

TEST-ONLY, like tests/verl_rollout_corr.py: AReaL is no requirement of this project; this script regenerates the
numbers that tests/test_decoupled.py holds --rollout-correction decoupled to. It calls AReaL's own
ppo_actor_loss_fn twice on the same inputs and records, for each, the loss, d loss / d logprobs and its stats:
  - AReaL 1.0.4 (the package), with rejection_sampling=RejectionSamplingConfig(level="token", action="mask",
    metric="ratio", upper=5.0): what AReaL's migration message maps the paper's behave_imp_weight_cap=5 to;
  - AReaL at commit 61d1bbb3d5c8891a76f5c461a5e1fde1dbf0270a (the paper-era functional.py), behav_imp_weight_cap=5.
Both with eps_clip 0.2, eps_clip_higher 0.28, c_clip 3.0, the token-level ratio, bool masks as AReaL's actor passes.

Reproduce from the repo root, in a virtualenv of its own outside the repo (CPU is enough; tests/verl_oracle.py
says where the small CPU wheel of torch is):
    python3.11 -m venv VENV
    VENV/bin/pip install torch==2.13.0
    VENV/bin/pip install --no-deps areal==1.0.4
    VENV/bin/pip install numpy==2.3.5 uvloop==0.23.0 PyYAML==6.0.4 hydra-core==1.4.0.dev1 omegaconf==2.4.0.dev2 \
        colorlog==6.12.0
    git -C AREAL_CLONE show 61d1bbb3d5c8891a76f5c461a5e1fde1dbf0270a:areal/utils/functional/functional.py > OLD.py
    VENV/bin/python tests/areal_decoupled.py OLD.py       # AREAL_CLONE: a clone of inclusionAI/AReaL
AReaL's package __init__ files import its whole system (ray, transformers, numba, aiohttp, ...), none of it on
functional.py's path. So this script, and only it, registers bare packages for areal, areal.api, areal.utils,
areal.utils.functional, areal.engine and areal.engine.fsdp_utils (their files load, their __init__ files do not),
and stubs four modules that functional.py does not use for metric="ratio": areal.engine.fsdp_utils.attn_impl
(transformers), areal.utils.name_resolve (ray), areal.utils.seqpack (numba) and areal.utils.data (its KLEstimator
serves the kl_* metrics only). areal/api/cli_args.py (RejectionSamplingConfig) and functional.py run as shipped.

Inputs: float32 draws from a seeded generator, widened to float64. Rows: right padding, one multi-turn row with a
hole in its mask (observation tokens whose log-probs are set wild so that a loss that read them would show), one
empty row. The behaviour log-probs are the proximal ones plus noise big enough that the cap 5 on
p_proximal / p_behave binds on some tokens and not on others; the current ones are the proximal ones plus small
noise (the eps clip binds) and, on some tokens, a jump of 1.5 (ratio > 3: with A < 0 the dual clip binds).
AReaL 1.0.4 computes the behaviour weight in float32 (its .float() "upcast"); the paper-era code in the input's
dtype: the two agree to float32's resolution, which this script asserts.
"""
import dataclasses, datetime, importlib.util, json, os, sys, types
import torch


def areal_1_0_4():
    """AReaL 1.0.4's functional module and RejectionSamplingConfig, without its package __init__ files (see above)."""
    root = os.path.dirname(importlib.util.find_spec("areal").origin)

    def module(name, path=None, **attrs):
        m = types.ModuleType(name)
        if path is not None:
            m.__path__ = [path]
        m.__dict__.update(attrs)
        sys.modules[name] = m

    for name in ("areal", "areal.api", "areal.utils", "areal.utils.functional", "areal.engine",
                 "areal.engine.fsdp_utils"):
        module(name, os.path.join(root, *name.split(".")[1:]))
    module("areal.engine.fsdp_utils.attn_impl", BUILTIN_ATTN_IMPLS=(), get_attn_impl_validation_error=None,
           is_valid_attn_impl=None)
    module("areal.utils.name_resolve")
    module("areal.utils.seqpack", PACKING_ALGORITHMS=())
    module("areal.utils.data", KLEstimator=None)
    from areal.api.cli_args import RejectionSamplingConfig
    from areal.utils.functional import functional
    from areal.version import __version__
    return functional, RejectionSamplingConfig, __version__


def paper_era(path):
    spec = importlib.util.spec_from_file_location("areal_61d1bbb_functional", path)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    return old


B, T = 7, 12
LENGTHS = [12, 7, 1, 5, 9]          # rows 0-4: right-padded; row 5: hole; row 6: empty
HOLE_ROW, EMPTY_ROW = 5, 6
CLIP = dict(eps_clip=0.2, eps_clip_higher=0.28, c_clip=3.0)
CAP, BEHAVE_SD, NEW_SD, JUMP = 5.0, 1.5, 0.3, 1.5

g = torch.Generator().manual_seed(5)
f32 = dict(generator=g, dtype=torch.float32)
mask = torch.zeros(B, T, dtype=torch.bool)
for r, n in enumerate(LENGTHS):
    mask[r, :n] = True
mask[HOLE_ROW, 0:4] = mask[HOLE_ROW, 7:10] = True     # multi-turn: tokens 0-3 and 7-9
prox32 = -(0.1 + 2.9 * torch.rand(B, T, **f32))
adv32 = torch.randn(B, T, **f32)
behave32 = prox32 + BEHAVE_SD * torch.randn(B, T, **f32)
new32 = prox32 + NEW_SD * torch.randn(B, T, **f32) + JUMP * (torch.rand(B, T, **f32) < 0.15)
behave32[HOLE_ROW, 4:7] = prox32[HOLE_ROW, 4:7] - 30.0  # observation tokens: a weight e^30, were it read
new32[HOLE_ROW, 4:7] = prox32[HOLE_ROW, 4:7] + 30.0     # and a ratio e^30
prox, adv, behave, new = (x.double() for x in (prox32, adv32, behave32, new32))


def run(loss_fn, **kw):
    x = new.clone().requires_grad_(True)
    loss, stat = loss_fn(logprobs=x, proximal_logprobs=prox, old_logprobs=behave, advantages=adv, loss_mask=mask,
                         **CLIP, **kw)
    loss.backward()
    assert loss.dtype == torch.float64 and x.grad.isfinite().all() and (x.grad[~mask] == 0).all()
    out = dict(loss=loss.item(), grad_logprobs=x.grad.tolist())
    for k in ("behave_imp_weight", "behave_mask", "clip_mask", "dual_clip_mask"):
        v = stat[k].detach()
        out[k] = (v.int() if v.dtype == torch.bool else v.double()).tolist()
    out["weight_dtype"] = str(stat["behave_imp_weight"].dtype)
    if "filtered_fraction" in stat:
        out["filtered_fraction"] = stat["filtered_fraction"]
    return out


functional, RejectionSamplingConfig, version = areal_1_0_4()
rs = RejectionSamplingConfig(level="token", action="mask", metric="ratio", upper=CAP)
new_code = run(functional.ppo_actor_loss_fn, rejection_sampling=rs)
old_code = run(paper_era(sys.argv[1]).ppo_actor_loss_fn, behav_imp_weight_cap=CAP)

# the fixture's inputs make each bound bind on some tokens and not on all
capped = mask & (prox - behave > torch.log(torch.tensor(CAP, dtype=torch.float64)))
assert 0 < capped.sum() < mask.sum(), int(capped.sum())
assert torch.equal(torch.tensor(old_code["behave_mask"]).bool(), mask & ~capped)
for k in ("clip_mask", "dual_clip_mask"):
    assert 0 < torch.tensor(new_code[k]).sum() < (mask & ~capped).sum(), k
# the two versions agree: the same tokens kept, the weights and loss to float32's resolution (1.0.4 is fp32 there)
assert new_code["behave_mask"] == old_code["behave_mask"]
assert new_code["filtered_fraction"] == capped.sum().item() / mask.sum().item()
torch.testing.assert_close(torch.tensor(new_code["behave_imp_weight"]), torch.tensor(old_code["behave_imp_weight"]),
                           rtol=2e-7, atol=0)
assert abs(new_code["loss"] - old_code["loss"]) <= 1e-6 * abs(old_code["loss"])
torch.testing.assert_close(torch.tensor(new_code["grad_logprobs"]), torch.tensor(old_code["grad_logprobs"]),
                           rtol=1e-6, atol=1e-12)

fixture = dict(
    about="AReaL's decoupled PPO actor loss on fixed inputs; regenerate with tests/areal_decoupled.py",
    areal_version=version, paper_commit="61d1bbb3d5c8891a76f5c461a5e1fde1dbf0270a", torch_version=torch.__version__,
    date=datetime.date.today().isoformat(), B=B, T=T, clip=CLIP, cap=CAP, rejection_sampling=dataclasses.asdict(rs),
    rows=dict(hole=HOLE_ROW, hole_tokens=[0, 1, 2, 3, 7, 8, 9], empty=EMPTY_ROW),
    noise_sd=dict(behave=BEHAVE_SD, new=NEW_SD, jump=JUMP),
    inputs=dict(loss_mask=mask.int().tolist(), proximal_logprobs=prox.tolist(), old_logprobs=behave.tolist(),
                logprobs=new.tolist(), advantages=adv.tolist()),
    areal_1_0_4=new_code, areal_61d1bbb=old_code)
path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "areal_decoupled.json")
with open(path, "w") as f:  # one line per top-level key and per version's entry
    f.write("{\n" + ",\n".join(f"{json.dumps(k)}: " + ("{\n" + ",\n".join(f"{json.dumps(a)}: {json.dumps(b)}"
                                                                            for a, b in v.items()) + "\n}"
                                                       if k.startswith("areal_") and isinstance(v, dict)
                                                       else json.dumps(v))
                               for k, v in fixture.items()) + "\n}\n")
print(f"AReaL {version}: loss {new_code['loss']!r}; 61d1bbb: loss {old_code['loss']!r}; "
      f"capped {int(capped.sum())}/{int(mask.sum())} tokens, clipped {sum(map(sum, new_code['clip_mask']))}, "
      f"dual-clipped {sum(map(sum, new_code['dual_clip_mask']))}")
print("wrote", path, os.path.getsize(path), "bytes")
