"""One PPO update of a fixed rollout (argv[2], if given, a saved one), under `torchrun --nproc_per_node=N`
(N = 1 or 2, gloo); with --lora, of rank-8 adapters on the policy and the critic (the value head whole).
Each rank trains on its slice of the same 32 rollouts with FSDP2-sharded models; rank 0 writes the
gradients of the first minibatch (before any step) and the full policy and critic parameters after four
epochs to argv[1], for test_fsdp.py to compare across world sizes."""
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ppo  # noqa: E402
import toy  # noqa: E402
from test_ppo_parts import rollout_batch  # noqa: E402

LORA = "--lora" in sys.argv
argv = [a for a in sys.argv if a != "--lora"]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
policy, critic, rollout, P = rollout_batch(toy.build_world(), B=32)  # identical on every rank (seeded)
if len(argv) > 2:  # a rollout a test saved instead (multi-turn episodes), on the same policy and critic
    saved = torch.load(argv[2], weights_only=True)
    P, rollout = saved.pop("P"), SimpleNamespace(**saved)
rows = slice(rank * 32 // world, (rank + 1) * 32 // world)
local = SimpleNamespace(**{k: v[rows] if torch.is_tensor(v) else v for k, v in vars(rollout).items()})
# global whitening: a rank's slice, whitened with all-reduced statistics, equals the slice of the whole
whole = ppo.masked_whiten(rollout.advantages, rollout.mask) if world == 1 else None
local.advantages = ppo.masked_whiten(local.advantages, local.mask)
if LORA:  # as ppo.load_models adds them, before sharding; B starts at 0, so the policy is the rollout's
    ppo.add_lora(policy, ppo.Args(lora_rank=8), "--model")
    ppo.add_lora(critic.seq_cls, ppo.Args(lora_rank=8), "the critic", head="score")
if world > 1:
    policy, critic = ppo.shard(policy, policy._no_split_modules), ppo.shard(critic, critic.seq_cls._no_split_modules)
opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=3e-4, eps=1e-5) for m in (policy, critic)]
args = ppo.Args(micro_batch_size=8)
ppo.check_args(args, 1)  # the defaults it resolves (--clip-eps...)
for epoch in range(4):
    ppo.minibatch_backward(policy, critic, local, torch.arange(len(local.mask)), P, args)
    if epoch == 0:  # the accumulated, rank-averaged gradient: AdamW and clipping would hide a lost scale
        grads = {f"{name}.{k}": (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                 for name, m in (("policy", policy), ("critic", critic)) for k, p in m.named_parameters()
                 if p.grad is not None}  # (LoRA: the adapters and the value head)
    ppo.optimizer_step((policy, critic), opts, args.max_grad_norm)
states = [ppo.full_state_dict(m) or m.state_dict() for m in (policy, critic)]
adv = [torch.zeros_like(rollout.advantages) for _ in range(world)]
dist.all_gather(adv, torch.nn.functional.pad(local.advantages, (0, 0, rows.start, 32 - rows.stop)))
if rank == 0:
    torch.save({"policy": states[0], "critic": states[1], "advantages": sum(adv), "grads": grads}, argv[1])
# no rank exits while another still works; then no interpreter teardown: a gloo worker thread freeing a gathered
# tensor there aborts the process ("terminate called without an active exception"), which a barrier and
# destroy_process_group made rarer but did not stop (2026-12-05, CI's kind of machine); the result is on disk
dist.barrier()
os._exit(0)
