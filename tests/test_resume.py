"""Never lose a run: the non-finite guard and a cut row (SIGKILL at every file-system step of checkpoints
and resume, damaged checkpoints, signals and locks: tests/test_reliability.py)."""
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
from test_in_process import run_main, without_timings
from test_precision import forced_overflow


def metrics(run):
    return [json.loads(line) for line in open(f"runs/{run}/metrics.jsonl")]


def kill_at_checkpoint(run, flags, step):
    """Start a fresh ppo.py run and SIGKILL it the moment its checkpoint of update `step` is in place."""
    shutil.rmtree(f"runs/{run}", ignore_errors=True)
    proc = subprocess.Popen([sys.executable, "ppo.py", "--run-name", run, *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not os.path.exists(f"runs/{run}/checkpoints/step_{step}") and time.time() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)


def straight_and_resumed(name, flags, step=1):
    """The same ppo.py run twice: straight through, and SIGKILLed once its checkpoint of update `step` is in
    place, then resumed. Returns the two run names (NAME_straight, NAME_resumed)."""
    runs = (f"{name}_straight", f"{name}_resumed")
    for run in runs:
        shutil.rmtree(f"runs/{run}", ignore_errors=True)
    subprocess.run([sys.executable, "ppo.py", "--run-name", runs[0], *flags], check=True, capture_output=True)
    kill_at_checkpoint(runs[1], flags, step)
    subprocess.run([sys.executable, "ppo.py", "--run-name", runs[1], "--resume", "auto", *flags], check=True,
                   capture_output=True)
    return runs


def test_nonfinite_steps_are_skipped_then_stop_the_run(world, monkeypatch):
    calls = {"n": 0}
    real = ppo.policy_loss

    def poisoned(*a, **kw):  # the second minibatch's loss is NaN, then all of them from the 10th on
        calls["n"] += 1
        loss, *rest = real(*a, **kw)
        return (loss * float("nan") if calls["n"] == 2 or calls["n"] >= 10 else loss), *rest

    monkeypatch.setattr(ppo, "policy_loss", poisoned)
    shutil.rmtree("runs/test_nan", ignore_errors=True)
    args = ppo.Args(run_name="test_nan", total_episodes=64 * 5, save_every=1, sample_every=0)
    with pytest.raises(ppo.UsageError, match="3 optimizer steps in a row"):
        ppo.main(args)
    rows = metrics("test_nan")
    assert rows[0]["ppo/skipped_steps"] == 1 and rows[1]["ppo/skipped_steps"] == 0
    assert len(rows) == 2  # update 3 hits three NaN steps in a row and stops
    for step in (1, 2):  # the checkpoints written are finite
        sd = torch.load(f"runs/test_nan/checkpoints/step_{step}/state.pt", weights_only=True)
        assert sd["step"] == step


def test_a_row_cut_short_by_the_kill_is_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "objec')
    ppo.truncate_jsonl(str(path), 3)
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n{"step": 3}\n'
    ppo.truncate_jsonl(str(path), 2)
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_a_run_with_dynamic_sampling_resumes_exactly(world):
    """Refill rounds after the resume point draw what the straight run drew (the refill stream is keyed by the
    update and the round, the samples by the restored generators)."""
    flags = ["--total-episodes", "256", "--reward-fn", "toy:gold_reward", "--adv-estimator", "grpo", "--group-size",
             "2", "--dynamic-sampling", "--save-every", "1", "--sample-every", "1"]
    runs = straight_and_resumed("test_dynamic", flags)
    straight, resumed = ([{k: v for k, v in r.items() if not k.startswith(("time/", "mem/"))} for r in metrics(run)]
                         for run in runs)
    assert resumed == straight and len(straight) == 4
    assert any(r["sampling/rounds"] > 0 for r in straight[1:])  # a refill after the resume point


@pytest.mark.fast
@pytest.mark.parametrize("case", ["critic-warmup", "lora-warmup", "fp16-skipped"])
def test_a_checkpoint_changes_nothing_in_the_run(world, case, monkeypatch):
    """Issue 62: saving every update logs the rows a run without saves logs, bit for bit, where an optimizer has not
    stepped when the first checkpoint is written: the policy's during a critic warm-up (with LoRA too), and both
    models' when fp16's loss scale skips every step of update 1 (2^24 overflows the toy's gradients down to 2^19;
    update 2 steps once the scale is down to 2^18). torch's state-dict call used to give such an AdamW the step count
    1, so every later step had the wrong bias correction."""
    flags = dict(total_episodes=64 * 3, **{
        "critic-warmup": dict(critic_warmup_updates=1),
        "lora-warmup": dict(critic_warmup_updates=1, lora_rank=8, learning_rate=3e-3),
        "fp16-skipped": dict(precision="fp16")}[case])
    if case == "fp16-skipped":
        forced_overflow(monkeypatch, init_scale=2.0 ** 24)
    plain = run_main(f"test_saves_off_{case}", **flags)
    saved = run_main(f"test_saves_on_{case}", **flags, save_every=1)
    assert without_timings(saved) == without_timings(plain)
    if case == "fp16-skipped":  # (the case holds: nothing stepped before the first save, something after)
        assert plain[0]["ppo/skipped_steps"] == plain[0]["ppo/epochs"] and plain[1]["ppo/skipped_steps"] < 4


@pytest.mark.fast
def test_no_checkpoint_is_written_with_non_finite_state(world, monkeypatch):
    """Issue 62 (docs/runs-that-die.md: never a checkpoint with non-finite weights): an AdamW moment turned inf by the
    update's last step stops the run in one line before the checkpoint is written; the folder holds no step_1."""
    real = ppo.optimizer_step

    def overflowing(models, optimizers, *a, **kw):
        out = real(models, optimizers, *a, **kw)
        next(iter(optimizers[-1].state.values()))["exp_avg"].fill_(float("inf"))  # the critic's first moment
        return out
    monkeypatch.setattr(ppo, "optimizer_step", overflowing)
    with pytest.raises(ppo.UsageError, match="update 1: the weights or AdamW's moments hold NaN or inf"):
        run_main("test_nonfinite_save", save_every=1)
    assert not os.path.exists("runs/test_nonfinite_save/checkpoints/step_1")
