"""Load a checkpoint (argv[1], a step_<k> folder) into a run's models and AdamW on this torchrun's number of
ranks, as `ppo.main` resumes one, then gather the weights and the optimizers' states whole and compare them,
bit for bit, with the checkpoint's own shards read whole (torch's dcp_to_torch_save); the run's newest checkpoint's
weights also with the final models the run saved after it, so a save that stored the wrong state fails too.
argv[2:]: the run's flags. Rank 0 writes "equal <n tensors>" or what differs to runs/<run>/reshard_<world>.txt."""
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ppo  # noqa: E402
import tyro  # noqa: E402

ckpt = sys.argv[1]
rank, world, device = ppo.init_distributed()
args = tyro.cli(ppo.Args, args=sys.argv[2:])
ppo.check_args(args, world)
models = ppo.load_models(args, device, lambda *a: None)
ppo.shard_models(models, args, device, world)
trained = [m for m in (models.policy, models.critic) if m is not None]
optimizers = [ppo.adamw([p for p in m.parameters() if p.requires_grad], 1e-3, args.fused_adamw, "x", lambda *a: None)
              for m in trained]
schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 1.0) for opt in optimizers]
ppo.restore(ckpt, models, optimizers, schedulers, None, None)
full = StateDictOptions(full_state_dict=True, cpu_offload=True)
loaded = {}
for name, model, opt in zip(("policy", "critic"), trained, optimizers):
    weights = get_model_state_dict(model, options=full)
    training = {n for n, p in model.named_parameters() if p.requires_grad}
    loaded[name] = {k: v for k, v in weights.items() if k in training}
    loaded[f"{name}_adamw"] = get_optimizer_state_dict(model, opt, options=full).get("state")  # (rank 0 alone)
if rank == 0:
    whole = os.path.join(os.path.dirname(ckpt), f"whole_{world}.pt")
    dcp_to_torch_save(os.path.join(ckpt, "shards"), whole)
    saved = torch.load(whole, weights_only=True)
    os.remove(whole)
    pairs = [(f"{name}.{k}", v, saved[name][k]) for name in ("policy", "critic") if name in loaded
             for k, v in loaded[name].items()]
    pairs += [(f"{name}_adamw.{k}.{s}", v, saved[f"{name}_adamw"]["state"][k][s]) for name in ("policy", "critic")
              if name in loaded for k, states in loaded[f"{name}_adamw"].items() for s, v in states.items()]
    run_dir = os.path.dirname(os.path.dirname(ckpt))
    if os.path.abspath(ckpt) == os.path.abspath(ppo.list_checkpoints(os.path.dirname(ckpt))[-1]):  # the last update's
        from safetensors.torch import load_file
        for name in [n for n in ("policy", "critic") if n in loaded]:
            final = load_file(os.path.join(run_dir, name, "model.safetensors"))  # (the critic's: without "seq_cls.")
            pairs += [(f"final {name}.{k}", v, final[k.removeprefix("seq_cls.")]) for k, v in loaded[name].items()
                      if k.removeprefix("seq_cls.") in final]
    missing = set(saved["policy"]) - set(loaded["policy"])
    wrong = [n for n, a, b in pairs if not torch.equal(torch.as_tensor(a), torch.as_tensor(b))] + sorted(missing)
    with open(os.path.join(run_dir, f"reshard_{world}.txt"), "w") as f:
        f.write(f"equal {len(pairs)}" if not wrong else "differ " + " ".join(wrong[:10]))
dist.barrier() if world > 1 else None
os._exit(0)  # (no interpreter teardown under gloo: see fsdp_update.py)
