"""Issue 55's measurement, under `torchrun --nproc_per_node=N experiments/ckpt_memory.py MODEL OUT.json`: a policy
and a critic of MODEL, FSDP2-sharded over N ranks with their AdamW states (made by a zero step), checkpointed
two ways, each rank's resident memory sampled every 2 ms by a thread while it saves:
  sharded:  ppo.save_checkpoint (torch.distributed.checkpoint: each rank writes its own shards);
  gathered: what ppo.py did before (its code up to issue 55, by the same torch calls): the weights and both
            optimizers' states gathered whole onto rank 0's CPU, then torch.save by rank 0;
in the order: the sharded save, ppo.restore of it, the final models' gathered weights (`full_state_dict`, what
save_pretrained writes at the end), the gathered save (last: what a process frees stays resident, and would hide
the peaks measured after it). Rank 0 writes, per way: its peak RSS above its RSS before, seconds, bytes."""
import json
import os
import sys
import threading
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ppo  # noqa: E402

MODEL, OUT = sys.argv[1], sys.argv[2]


def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024


def measured(fn):
    """fn() while a thread samples this process's RSS: (peak MB above the RSS before, seconds)."""
    before, peak, done = rss_mb(), [0.0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_mb())
            time.sleep(0.002)
    thread = threading.Thread(target=sample)
    thread.start()
    if dist.is_initialized():
        dist.barrier()
    t0 = time.perf_counter()
    fn()
    if dist.is_initialized():
        dist.barrier()
    seconds = time.perf_counter() - t0
    done.set()
    thread.join()
    return round(max(peak[0], rss_mb()) - before), round(seconds, 2)


def folder_bytes(path):
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


rank, world, device = ppo.init_distributed()
policy = ppo.disable_dropout(AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32))
critic = ppo.ValueModel(ppo.disable_dropout(AutoModelForSequenceClassification.from_pretrained(
    MODEL, num_labels=1, dtype=torch.float32)))
if world > 1:
    policy = ppo.shard(policy, policy._no_split_modules or [])
    critic = ppo.shard(critic, critic.seq_cls._no_split_modules or [])
models = SimpleNamespace(policy=policy, critic=critic)
optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-6, eps=1e-5) for m in (policy, critic)]
ppo.trained_state(models, optimizers)  # (AdamW's states made: a zero step, as on a resume)
args = ppo.Args(keep_checkpoints=1)
run_dir = f"runs/ckpt_memory_{world}"
out = {"ranks": world, "parameters": sum(p.numel() for m in (policy, critic) for p in m.parameters())}  # (global)
out["rss_before_mb"] = round(rss_mb())

out["sharded_peak_mb"], out["sharded_s"] = measured(lambda: ppo.save_checkpoint(
    args, run_dir, 1, models, optimizers, [], None, 0.05, -1.0, device))
out["load_peak_mb"], out["load_s"] = measured(lambda: ppo.restore(f"{run_dir}/checkpoints/step_1", models, optimizers,
                                                                  [], None, None))
out["final_gather_peak_mb"], out["final_gather_s"] = measured(
    lambda: [ppo.full_state_dict(m) for m in (policy, critic)])  # (one process: save_pretrained reads the module)


def gathered():
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = {"weights": [get_model_state_dict(m, options=full) for m in (policy, critic)],
             "optimizers": [get_optimizer_state_dict(m, o, options=full) for m, o in zip((policy, critic), optimizers)]}
    if rank == 0:
        torch.save(state, f"{run_dir}/gathered.pt")


out["gathered_peak_mb"], out["gathered_s"] = measured(gathered)  # last: its gathered copy stays resident
if rank == 0:
    out["sharded_bytes"] = folder_bytes(f"{run_dir}/checkpoints/step_1")
    out["gathered_bytes"] = os.path.getsize(f"{run_dir}/gathered.pt")
    json.dump(out, open(OUT, "w"), indent=1)
    print(json.dumps(out))
if world > 1:
    dist.barrier()
os._exit(0)
