"""ppo.py run as a user runs it: through a subprocess, on the toy world."""
import ast
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

KEYS = ["step", "episode", "objective/scores", "objective/kl", "objective/non_score_reward",
        "objective/rlhf_reward", "objective/entropy", "ppo/policy/approxkl_avg", "ppo/policy/clipfrac_avg",
        "ppo/loss/policy_avg", "ppo/loss/value_avg", "ppo/val/clipfrac_avg", "ppo/val/ratio",
        "ppo/val/explained_variance", "ppo/val/eos_rate", "ppo/val/response_length", "time/rollout_s",
        "time/update_s", "objective/gold"]


def run(*flags, env=None):
    shutil.rmtree(f"runs/{flags[1]}", ignore_errors=True)  # flags start with --run-name NAME
    return subprocess.run([sys.executable, "ppo.py", *flags], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


def test_a_few_updates_write_every_metric_and_a_loadable_checkpoint(world):
    out = run("--run-name", "test_e2e", "--total-episodes", "192", "--batch-size", "64",
              "--micro-batch-size", "16", "--num-minibatches", "2", "--sample-every", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in open("runs/test_e2e/metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # not a terminal: a line per update, and no progress bar whose redraws would bury them in a log
    assert all(f"update {u:4d}  score" in out.stdout for u in (1, 2, 3)) and "update/s" not in out.stderr
    for key in KEYS:
        assert all(key in r and r[key] == r[key] for r in rows), key  # present and not NaN
    assert all(r["ppo/policy/ratio_at_start"] < 1e-5 for r in rows)  # the check's own tolerance is 1e-3
    assert 0 <= rows[-1]["objective/gold"] <= 1 and rows[-1]["episode"] == 192
    assert len(out.stdout.splitlines()) >= 3 and "update    3" in out.stdout
    samples = [json.loads(line) for line in open("runs/test_e2e/samples.jsonl")]
    assert {s["step"] for s in samples} == {2, 3} and all("response" in s for s in samples)
    assert json.load(open("runs/test_e2e/config.json"))["micro_batch_size"] == 16
    policy = AutoModelForCausalLM.from_pretrained("runs/test_e2e/policy")
    initial = AutoModelForCausalLM.from_pretrained(world[0])
    assert not torch.equal(policy.lm_head.weight, initial.lm_head.weight)  # it trained
    AutoModelForSequenceClassification.from_pretrained("runs/test_e2e/critic")


def test_the_other_reward_and_critic_options_run(world):
    out = run("--run-name", "test_options", "--total-episodes", "128", "--response-length", "3",
              "--bootstrap-truncated", "--missing-eos-penalty", "None", "--kl-estimator", "k3", "--whiten-rewards",
              "--critic-init", "policy", "--kl-target", "1.0", "--ent-coef", "0.01", "--no-anneal-lr")
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in open("runs/test_options/metrics.jsonl")]
    assert rows[0]["ppo/val/eos_rate"] < 1  # three tokens: some responses are cut, and bootstrapped
    assert all(r["objective/kl"] >= 0 for r in rows)  # k3 is non-negative
    # adaptive KL: the KL of the first update is below the target, so beta shrinks by the clipped step
    assert abs(rows[0]["objective/kl_coef"] - 0.05 * (1 - 0.2 * 64 / 10000)) < 1e-9
    assert rows[0]["lr/actor"] == rows[1]["lr/actor"]  # --no-anneal-lr


def test_wandb_offline(world, tmp_path):
    out = run("--run-name", "test_wandb", "--total-episodes", "64", "--track",
              env={"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"})
    assert out.returncode == 0, out.stderr[-2000:]
    found = [f for _, _, files in os.walk("runs/test_wandb") for f in files if f.endswith(".wandb")]
    assert found, "no offline wandb run file written"


@pytest.mark.fast
def test_every_args_field_is_read():
    src = open("ppo.py").read()
    tree = ast.parse(src)
    args = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Args")
    fields = [n.target.id for n in args.body if isinstance(n, ast.AnnAssign)]
    assert len(fields) > 20
    src += open("adapters.py").read() + open("tools.py").read()  # (the glue reads a few: --vllm's, --tools')
    unread = [f for f in fields if not re.search(rf"args\.{f}\b", src)]
    assert not unread, f"flags that do nothing: {unread}"
