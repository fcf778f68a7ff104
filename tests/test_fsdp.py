"""torchrun + FSDP2 over gloo: two ranks compute the same update as one process."""
import json
import os
import shutil
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification


def torchrun(n, *cmd):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}",
                           "--master_port", str(29500 + n), *cmd], capture_output=True, text=True, timeout=600)


def test_two_ranks_update_equals_one_process(world, tmp_path):
    results = {}
    for n in (1, 2):
        out = torchrun(n, "tests/fsdp_update.py", str(tmp_path / f"w{n}.pt"))
        assert out.returncode == 0, out.stderr[-3000:]
        results[n] = torch.load(tmp_path / f"w{n}.pt", weights_only=True)
    torch.testing.assert_close(results[2]["advantages"], results[1]["advantages"], atol=1e-6, rtol=0)
    initial = AutoModelForCausalLM.from_pretrained(world[0]).state_dict()
    moved = max((results[1]["policy"][k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-4  # the update did something
    for model in ("policy", "critic"):
        one, two = results[1][model], results[2][model]
        assert one.keys() == two.keys()
        for k in one:
            torch.testing.assert_close(two[k], one[k], atol=1e-5, rtol=0, msg=f"{model}.{k}")


def test_two_rank_run_logs_once_per_update_and_saves(world):
    shutil.rmtree("runs/test_fsdp", ignore_errors=True)
    out = torchrun(2, "ppo.py", "--run-name", "test_fsdp", "--total-episodes", "192", "--micro-batch-size", "16")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in open("runs/test_fsdp/metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]  # rank 0 alone logs
    assert out.stdout.count("update    2") == 1
    assert json.load(open("runs/test_fsdp/config.json"))["world_size"] == 2
    assert all(r["ppo/policy/ratio_at_start"] < 1e-3 for r in rows)
    policy = AutoModelForCausalLM.from_pretrained("runs/test_fsdp/policy")
    assert not torch.equal(policy.lm_head.weight, AutoModelForCausalLM.from_pretrained(world[0]).lm_head.weight)
    AutoModelForSequenceClassification.from_pretrained("runs/test_fsdp/critic")
