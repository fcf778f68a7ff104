"""Never lose a run: exact resume after SIGKILL, atomic checkpoints, the non-finite guard."""
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

FLAGS = ["--total-episodes", "384", "--batch-size", "64", "--save-every", "3", "--sample-every", "1"]


def metrics(run):
    return [json.loads(line) for line in open(f"runs/{run}/metrics.jsonl")]


def strip_times(row):
    return {k: v for k, v in row.items() if not k.startswith(("time/", "mem/"))}


@pytest.fixture(scope="module")
def straight(world):
    """A straight 6-update run with checkpoints at 3 and 6, for the tests below (each may run alone)."""
    shutil.rmtree("runs/test_straight", ignore_errors=True)
    out = subprocess.run([sys.executable, "ppo.py", "--run-name", "test_straight", *FLAGS],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return "test_straight"


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


def test_sigkill_after_checkpoint_then_resume_is_exact(straight):
    kill_at_checkpoint("test_killed", FLAGS, 3)  # right after the checkpoint at update 3 is in place
    assert os.path.exists("runs/test_killed/checkpoints/step_3/state.pt")
    assert not os.path.exists("runs/test_killed/policy")  # it really died before the end
    # an update's rows are written before its checkpoint, so a kill right after step_3 appears keeps them
    assert 3 in [r["step"] for r in metrics("test_killed")]
    assert 3 in [json.loads(line)["step"] for line in open("runs/test_killed/samples.jsonl")]

    resumed = subprocess.run([sys.executable, "ppo.py", "--run-name", "test_killed", *FLAGS, "--resume", "auto"],
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "checkpoints/step_3" in resumed.stdout
    a, b = metrics("test_straight"), metrics("test_killed")
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]  # no row lost, none doubled
    assert [strip_times(r) for r in a] == [strip_times(r) for r in b]  # bit-exact, every key
    sa = [json.loads(line) for line in open("runs/test_straight/samples.jsonl")]
    sb = [json.loads(line) for line in open("runs/test_killed/samples.jsonl")]
    assert sa == sb


def test_interrupted_checkpoint_write_leaves_the_previous_one(straight, tmp_path):
    run = "test_interrupted"
    shutil.rmtree(f"runs/{run}", ignore_errors=True)
    shutil.copytree(f"runs/{straight}", f"runs/{run}")  # a copy: the straight run stays as it was
    root = f"runs/{run}/checkpoints"
    # what a kill in the middle of save_checkpoint leaves: a half-written temporary folder
    os.makedirs(f"{root}/step_9.tmp/policy")
    open(f"{root}/step_9.tmp/policy/model.safetensors", "wb").write(b"\0" * 10)
    assert ppo.list_checkpoints(root)[-1].endswith("step_6")
    out = subprocess.run([sys.executable, "ppo.py", "--run-name", run, *FLAGS[:-4], "--total-episodes", "448",
                          "--resume", "auto", "--save-every", "7"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "checkpoints/step_6" in out.stdout
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4, 5, 6, 7]
    assert os.path.exists(f"{root}/step_7/state.pt") and not os.path.exists(f"{root}/step_3")  # keep 2


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
