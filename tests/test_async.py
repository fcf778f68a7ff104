"""--async-steps 1: the sampler process against a synchronous simulation of it, exact resume through a kill, the
sampler dying, the refusals. The decoupled loss against AReaL's own code: tests/test_decoupled.py."""
import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import ppo
from fp32 import logprob_tolerance
from test_in_process import run_main, without_timings
from test_resume import metrics, straight_and_resumed

FLAGS = dict(total_episodes=5 * 32, batch_size=32, response_length=12, sample_every=1)
CLI = [f"--{k.replace('_', '-')}={v}" for k, v in FLAGS.items()] + ["--async-steps", "1"]
ONE_CORE_EACH = dict(os.environ, OMP_NUM_THREADS="2")  # the trainer keeps 1 thread, the sampler gets 1


class Simulated:
    """What --async-steps 1 should compute, written without a process, a queue or shared weights: each update's
    batch drawn in this process by a copy of the weights of two updates before (the first two by the first)."""
    def __init__(self, policy, tokenizer, args, device, ready=None):
        self.tokenizer, self.args, self.device, self.starts, self.seconds = tokenizer, args, device, [], 0.0

    def take(self, update, policy, prompt_ids, last):
        self.starts.append(copy.deepcopy(policy))  # the weights at update `update`'s start
        lagged = self.starts[max(update - 2, 0)]  # those after update - 2
        rows = ppo.prompt_order(update, len(prompt_ids), self.args, 0, self.args.batch_size)
        return ppo.draw(lagged, self.tokenizer, [prompt_ids[i] for i in rows], self.args, update, self.device)

    def close(self):
        pass


@pytest.mark.mutants
def test_the_sampler_process_draws_what_a_synchronous_simulation_draws(world, monkeypatch):
    """Every metric of 5 updates (sampled texts and scores included) equals a simulation that samples each batch
    with the weights of two updates before; and a staleness of 0 at update 1, of 1 after it."""
    shutil.rmtree("runs/test_async", ignore_errors=True)
    out = subprocess.run([sys.executable, "ppo.py", "--run-name", "test_async", *CLI], env=ONE_CORE_EACH,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    real = without_timings(metrics("test_async"))
    monkeypatch.setattr(ppo, "Sampler", Simulated)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each process of the real run
    try:
        simulated = without_timings(run_main("test_async_sim", async_steps=1, **FLAGS))
    finally:
        torch.set_num_threads(threads)
    assert real == simulated
    samples = [json.loads(line) for line in open("runs/test_async/samples.jsonl")]
    sim_samples = [json.loads(line) for line in open("runs/test_async_sim/samples.jsonl")]
    assert samples == sim_samples and len({s["response"] for s in samples}) > 10
    # the sampler and the proximal policy: the same weights at update 1 (generation's cache rounds otherwise), not after
    assert real[0]["rollout/logprob_diff_max"] < logprob_tolerance("runs/toy/policy")  # (two orders of fp32 sums)
    assert all(r["rollout/logprob_diff_max"] > 1e-3 for r in real[1:])


@pytest.mark.mutants
def test_a_run_killed_after_a_checkpoint_resumes_exactly(world):
    """The batch drawn ahead is saved with the checkpoint and taken from it on resume."""
    straight, resumed = straight_and_resumed("test_async_kill", [*CLI, "--save-every", "1"], step=2)
    assert without_timings(metrics(straight)) == without_timings(metrics(resumed))
    state = torch.load(f"runs/{resumed}/checkpoints/step_4/state.pt", weights_only=True)
    assert state["drawn"][0] == 5  # update 5's batch, drawn during update 4


def children(pid):
    tasks = os.listdir(f"/proc/{pid}/task")
    return [int(c) for t in tasks for c in open(f"/proc/{pid}/task/{t}/children").read().split()]


def test_the_sampler_dying_is_one_line_and_the_checkpoints_resume(world):
    shutil.rmtree("runs/test_async_dies", ignore_errors=True)
    flags = ["--run-name", "test_async_dies", *CLI, "--save-every", "1", "--total-episodes", str(40 * 32)]
    run = subprocess.Popen([sys.executable, "ppo.py", *flags], stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not os.path.exists("runs/test_async_dies/checkpoints/step_2") and time.time() < deadline:
        time.sleep(0.01)
    sampler = [c for c in children(run.pid) if "spawn_main" in open(f"/proc/{c}/cmdline").read()]
    assert len(sampler) == 1
    os.kill(sampler[0], signal.SIGKILL)
    err = run.communicate(timeout=300)[1]
    assert run.returncode == 2 and len(err.strip().splitlines()) == 1, err[-2000:]
    assert "the sampler process died (exit code -9)" in err and "--resume auto continues" in err
    done = len(metrics("test_async_dies"))
    assert 2 <= done < 40
    again = subprocess.run([sys.executable, "ppo.py", *flags[:-2], "--total-episodes", str((done + 1) * 32),
                            "--resume", "auto"], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert [r["step"] for r in metrics("test_async_dies")] == list(range(1, done + 2))


@pytest.mark.fast
@pytest.mark.parametrize("flags", [dict(model="guess"), dict(vllm=True), dict(lora_rank=4), dict(fp32_head=True),
                                   dict(dynamic_sampling=True, adv_estimator="grpo", group_size=4)])
def test_what_is_not_written_yet_is_refused(flags):
    with pytest.raises(ppo.UsageError, match="--async-steps 1 with torchrun, --env"):
        ppo.check_args(ppo.Args(async_steps=1, **flags), 1)
    with pytest.raises(ppo.UsageError, match="--async-steps 1 with torchrun"):
        ppo.check_args(ppo.Args(async_steps=1), 2)


@pytest.mark.fast
def test_the_decoupled_objective_is_the_default_and_the_coupled_one_an_ablation():
    args = ppo.Args(async_steps=1)
    ppo.check_args(args, 1)
    assert (args.rollout_correction, args.rollout_correction_low, args.rollout_correction_high) == ("decoupled", 0, 5)
    assert args.old_logprobs == "recompute"  # the proximal policy: the weights at the update's start
    args = ppo.Args(async_steps=1, old_logprobs="sampler")  # PPO's ratio against the behaviour policy itself
    ppo.check_args(args, 1)
    assert args.rollout_correction is None and args.ratio_check_tol == float("inf")  # (one update behind: no check)


@pytest.mark.fast
def test_the_sampler_gives_its_threads_back_and_checks_the_batch_it_hands_over(world):
    """Issue 62: the trainer halves torch's threads for the sampler process and has them back once it closes; a batch
    drawn for another update is refused with a RuntimeError, which `python -O` keeps (it drops an assert)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    policy = AutoModelForCausalLM.from_pretrained(world[0])
    tokenizer = AutoTokenizer.from_pretrained(world[0], padding_side="left")
    args = ppo.Args(async_steps=1, **FLAGS)
    ppo.check_args(args, 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # (whatever this worker has: two, to halve)
    try:
        sampler = ppo.Sampler(policy, tokenizer, args, torch.device("cpu"), ready=(5, []))  # update 5's batch
        assert torch.get_num_threads() == 1
        with pytest.raises(RuntimeError, match="update 6 was given the batch of update 5"):
            sampler.take(6, policy, [[1, 2]], last=True)
        sampler.close()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
