"""torchrun + FSDP2 over gloo: two ranks compute the same update as one process."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from fp32 import assert_close_fp32, ratio_tolerance


def free_port():
    with socket.socket() as s:  # a port nobody holds now, not one a killed run may still hold
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(n, *cmd):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}",
                           "--master_port", str(free_port()), *cmd], capture_output=True, text=True, timeout=600)


@pytest.mark.mutants  # outside the fast subset for its time; the mutation check runs it
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_two_ranks_update_equals_one_process(world, tmp_path, lora):
    results = {}
    for n in (1, 2):
        out = torchrun(n, "tests/fsdp_update.py", str(tmp_path / f"w{n}.pt"), *["--lora"] * lora)
        assert out.returncode == 0, out.stderr[-3000:]
        results[n] = torch.load(tmp_path / f"w{n}.pt", weights_only=True)
    advantages = results[1]["advantages"]  # whitened by a mean and a variance summed over the ranks' tokens
    assert_close_fp32(results[2]["advantages"], advantages, advantages.numel())
    # the gradient before any step: each rank's loss x N, averaged by FSDP, is the whole minibatch's
    one, two = results[1]["grads"], results[2]["grads"]
    assert one.keys() == two.keys() and max(g.abs().max().item() for g in one.values()) > 1e-3
    tokens = 32 * 12  # two half-sums and an all-reduce instead of one sum over the minibatch's tokens (at most)
    for k in one:  # measured: at most 6e-8 apart (largest |g| 0.67), on AVX2 and AVX-512 alike
        assert_close_fp32(two[k], one[k], tokens, msg=k)
    if lora:  # the adapters and the value head alone have gradients; B starts at 0, so moving B is the update
        assert all(".lora_" in k or ".score." in k for k in one) and any(".score." in k for k in one)
        moved = max(v.abs().max().item() for k, v in results[1]["policy"].items() if ".lora_B." in k)
    else:
        initial = AutoModelForCausalLM.from_pretrained(world[0]).state_dict()
        moved = max((results[1]["policy"][k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-4  # the update did something
    for model in ("policy", "critic"):
        one, two = results[1][model], results[2][model]
        assert one.keys() == two.keys()
        for k in one:
            torch.testing.assert_close(two[k], one[k], atol=1e-5, rtol=0, msg=f"{model}.{k}")


def descendants(pid):
    """The processes started by `pid`, and by them, from /proc (torchrun's ranks may sit in their own groups)."""
    kids = []
    for task in os.listdir(f"/proc/{pid}/task") if os.path.exists(f"/proc/{pid}/task") else []:
        try:
            kids += [int(c) for c in open(f"/proc/{pid}/task/{task}/children").read().split()]
        except OSError:
            pass
    return kids + [d for k in kids for d in descendants(k)]


def kill_tree(pid, timeout=60):
    """SIGKILL a process and its descendants, then wait (at most `timeout` s) until they are gone."""
    pids = [pid] + descendants(pid)
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.time() + timeout
    while any(os.path.exists(f"/proc/{p}") and "zombie" not in open(f"/proc/{p}/status").read().lower()
              for p in pids if p != pid) and time.time() < deadline:
        time.sleep(0.05)


def two_rank_run(name, *flags):
    """A 3-update toy run on 2 ranks: its metrics rows and the launcher's output."""
    shutil.rmtree(f"runs/{name}", ignore_errors=True)
    out = torchrun(2, "ppo.py", "--run-name", name, "--total-episodes", "192", "--micro-batch-size", "16", *flags)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in open(f"runs/{name}/metrics.jsonl")], out


def without_timings(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "mem/"))} for r in rows]


def test_two_rank_run_logs_once_per_update_and_saves(world):
    rows, out = two_rank_run("test_fsdp")
    assert [r["step"] for r in rows] == [1, 2, 3]  # rank 0 alone logs
    assert out.stdout.count("update    2") == 1
    assert json.load(open("runs/test_fsdp/config.json"))["world_size"] == 2
    assert all(r["ppo/policy/ratio_at_start"] < 1e-5 for r in rows)  # the check's own tolerance is 1e-3
    policy = AutoModelForCausalLM.from_pretrained("runs/test_fsdp/policy")
    assert not torch.equal(policy.lm_head.weight, AutoModelForCausalLM.from_pretrained(world[0]).lm_head.weight)
    AutoModelForSequenceClassification.from_pretrained("runs/test_fsdp/critic")


def test_offloading_the_frozen_models_changes_no_number(world):
    # sharded: FSDP2's CPU offload; --no-shard-frozen: whole copies moved around phase 3. On this CPU-only
    # machine the device is the CPU too, so this shows the paths run and leave the update as it was;
    # that the accelerator is freed can only be seen on a GPU
    baseline = without_timings(two_rank_run("test_fsdp_no_offload")[0])
    for flags in (["--offload-frozen"], ["--offload-frozen", "--no-shard-frozen"]):
        assert without_timings(two_rank_run("test_fsdp_offload", *flags)[0]) == baseline, flags


def test_two_rank_sigkill_then_resume_is_exact(world):
    flags = ["--total-episodes", "512", "--save-every", "2", "--sample-every", "1"]
    for run in ("test_fsdp_straight", "test_fsdp_killed"):
        shutil.rmtree(f"runs/{run}", ignore_errors=True)
    out = torchrun(2, "ppo.py", "--run-name", "test_fsdp_straight", *flags)
    assert out.returncode == 0, out.stderr[-3000:]
    proc = subprocess.Popen(["nice", "-n", "10", sys.executable, "-m", "torch.distributed.run",  # the test polls first
                             "--nproc_per_node=2", "--master_port", str(free_port()), "ppo.py",
                             "--run-name", "test_fsdp_killed", *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while not os.path.exists("runs/test_fsdp_killed/checkpoints/step_2") and time.time() < deadline:
        assert proc.poll() is None, "the run to be killed ended by itself"
        time.sleep(0.005)
    kill_tree(proc.pid)  # the launcher and both ranks it started, and nothing else
    proc.wait(timeout=60)
    assert not os.path.exists("runs/test_fsdp_killed/policy")
    out = torchrun(2, "ppo.py", "--run-name", "test_fsdp_killed", *flags, "--resume", "auto")
    assert out.returncode == 0, out.stderr[-3000:]
    resumed_from = int(out.stdout.split("checkpoints/step_")[1].split()[0])
    assert resumed_from < 8  # resumed mid-run, not restarted and not at the end
    a, b = ([json.loads(line) for line in open(f"runs/{run}/metrics.jsonl")] for run in ("test_fsdp_straight", "test_fsdp_killed"))
    assert [r["step"] for r in b] == list(range(1, 9))
    assert without_timings(a) == without_timings(b)  # every rank's sampler, both optimizers' shards restored


def test_two_ranks_with_a_token_budget_step_together(world):
    # each rank packs its own rows by length: the counts of micro-batches differ until the largest are
    # halved, and a rank that forwards once more than the other would hang in the FSDP all-gather
    shutil.rmtree("runs/test_fsdp_budget", ignore_errors=True)
    out = torchrun(2, "ppo.py", "--run-name", "test_fsdp_budget", "--total-episodes", "192", "--micro-batch-tokens",
                   "120", "--save-every", "0")
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in open("runs/test_fsdp_budget/metrics.jsonl")]
    assert len(rows) == 3 and all(r["ppo/policy/ratio_at_start"] < 1e-5 for r in rows)


def test_two_rank_lora_run_resumes_exactly_and_saves_its_adapters(world):
    # FSDP2 with adapters: the sharded optimizers hold the adapters' and the value head's states alone, a
    # resume from update 1's checkpoint (adapters, heads, states; the bases from --model) gives the same rows,
    # and the saved merged policy is the saved adapter on the base, gathered from the shards
    from peft import PeftModel
    from test_sharded import checkpoint_contents  # (here: that file imports this one)
    flags = ["--lora-rank", "4", "--learning-rate", "1e-3", "--save-every", "1", "--keep-checkpoints", "3"]
    straight, _ = two_rank_run("test_fsdp_lora", *flags)
    out = torchrun(2, "ppo.py", "--run-name", "test_fsdp_lora", "--total-episodes", "192", "--micro-batch-size", "16",
                   *flags, "--resume", "runs/test_fsdp_lora/checkpoints/step_1")
    assert out.returncode == 0, out.stderr[-3000:]
    resumed = [json.loads(line) for line in open("runs/test_fsdp_lora/metrics.jsonl")]
    assert [r["step"] for r in resumed] == [1, 2, 3] and without_timings(resumed) == without_timings(straight)
    tol = ratio_tolerance("runs/toy/policy")
    assert all(r["ppo/policy/ratio_at_start"] < tol for r in straight)
    whole = checkpoint_contents("runs/test_fsdp_lora/checkpoints/step_3")
    policy_opt, critic_opt = whole["policy_adamw"]["state"], whole["critic_adamw"]["state"]
    assert all(".lora_" in k for k in policy_opt) and all(".lora_" in k or ".score." in k for k in critic_opt)
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(world[0])
        ids = torch.randint(0, base.config.vocab_size, (4, 12))
        merged = AutoModelForCausalLM.from_pretrained("runs/test_fsdp_lora/policy")(ids).logits
        before = base(ids).logits
        adapted = PeftModel.from_pretrained(base, "runs/test_fsdp_lora/policy_adapter")(ids).logits  # (in place)
    assert_close_fp32(merged, adapted, 256)  # (the toy's longest sum: its MLP's 256 units)
    assert (merged - before).abs().max() > 1e-3  # the adapters trained


def test_two_ranks_with_dynamic_sampling_keep_as_many_groups_each(world):
    """Each rank drops its own groups without a signal, and all keep as many as the rank with the fewest: the
    same minibatches on both, or the sharded forwards would wait for each other forever (the timeout)."""
    rows, _ = two_rank_run("test_fsdp_dynamic", "--reward-fn", "toy:gold_reward", "--adv-estimator", "grpo",
                           "--group-size", "2", "--dynamic-sampling", "--dynamic-sampling-rounds", "0")
    assert [r["step"] for r in rows] == [1, 2, 3]  # no refill: each rank holds what its own batch had
    assert all(0 < r["sampling/trained_groups"] < 32 and r["sampling/trained_groups"] % 2 == 0 for r in rows)
    assert all(r["ppo/policy/ratio_at_start"] < 1e-5 for r in rows)
