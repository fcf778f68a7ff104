"""bench.py end to end at tiny settings: one JSON line of positive figures, on the toy world and on a real
tokenizer's checkpoint with a reward function; tests/gpu_check.sh ends cleanly without a GPU."""
import json
import os
import subprocess
import sys

import pytest
import torch

import real_models

KEYS = ["update_s", "generate_s", "score_s", "ppo_epochs_s", "log_s", "generated_tokens_per_s",
        "trained_tokens_per_s", "peak_mem_mb", "floor_update_s", "floor_generate_s", "floor_score_s",
        "floor_ppo_epochs_s"]


def test_bench_prints_a_table_and_a_json_line(world):
    out = subprocess.run([sys.executable, "bench.py", "--updates", "8", "--batch-size", "16",
                          "--response-length", "16", "--num-ppo-epochs", "2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| total per update" in out.stdout
    res = json.loads(out.stdout.strip().splitlines()[-1])
    for key in KEYS:
        assert res[key] > 0, key
    assert res["push_s"] >= 0 and "trl_update_s" not in res  # no TRL without --trl-python
    # no timing is compared with another run's (a shared CPU's noise); within a row the whole update holds
    # its PPO epochs, so the median of the totals is at least the median of the epochs
    assert res["update_s"] >= res["ppo_epochs_s"]


def test_bench_on_another_checkpoint_with_a_reward_function(tmp_path):
    # the floor is built from the same flags: a Qwen2-tokenizer policy, its chat prompts, a Python reward
    prompts = real_models.write_prompts(tmp_path / "prompts.jsonl")
    out = subprocess.run([sys.executable, "bench.py", "--model", real_models.build("qwen2"), "--dataset", str(prompts),
                          "--reward-fn", "tests/real_models.py:reward", "--updates", "3", "--batch-size", "8",
                          "--response-length", "8", "--num-ppo-epochs", "1", "--micro-batch-size", "4",
                          "--eval-fraction", "0"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("runs/real/qwen2: batch 8") == 1
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(res[k] > 0 for k in KEYS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script runs the GPU checks")
def test_gpu_check_script_ends_cleanly_without_a_gpu(tmp_path):
    out = subprocess.run(["bash", "tests/gpu_check.sh"], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OUT=str(tmp_path)))
    assert out.returncode == 0 and "no CUDA GPU here" in out.stdout
    assert json.load(open(tmp_path / "gpu_check.json")) == {"skipped": "no CUDA GPU"}


def test_a_scaling_point_measured_again_replaces_its_row_and_only_it(tmp_path):
    import bench
    path = str(tmp_path / "scaling.json")

    def row(point, flags, cpu):
        vocab, length, body = point.split(",")
        return dict(point=point, vocab=vocab, length=int(length), body=body, flags=flags, ours_cpu_s=cpu,
                    plain_cpu_s=2.0, floor_cpu_s=2.0, ours_rss_mb=1.0, plain_rss_mb=2.0)
    bench.save_row(row("152k,256,10M", "", 3.0), path)
    bench.save_row(row("8k,256,10M", "", 1.0), path)
    bench.save_row(row("152k,256,10M", "--vllm", 5.0), path)  # another row: other flags
    table = bench.save_row(row("152k,256,10M", "", 4.0), path)  # the same point again: its row replaced
    assert sorted((r["point"], r["flags"], r["ours_cpu_s"]) for r in table) == [
        ("152k,256,10M", "", 4.0), ("152k,256,10M", "--vllm", 5.0), ("8k,256,10M", "", 1.0)]
    assert json.load(open(path)) == table
    lines = bench.scaling_table(table)
    assert [line.split(" | ")[2] for line in lines[2:]] == ["10M", "10M", "10M --vllm"]  # by vocabulary, flagged last
    assert lines[3].split(" | ")[3:10] == ["4.0", "2.0", "-", "2.0", "-", "2.00", "+100.0%"]  # no TRL: dashes
