"""Never lose a run, part 2: kills at every file-system step, one process per run, resumes that verify
their checkpoint and refuse changed flags, signals that stop cleanly, and every bad input in one line."""
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
import runfiles

FLAGS = ["--total-episodes", "384", "--batch-size", "64", "--save-every", "3", "--sample-every", "1"]
QUICK = dict(total_episodes=32, batch_size=16, response_length=8, num_ppo_epochs=1, sample_every=0, save_every=0)


def rows(run, name="metrics.jsonl"):
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "mem/"))}
            for line in open(f"runs/{run}/{name}")]


def cli(*flags, timeout=600):
    return subprocess.run([sys.executable, "ppo.py", *flags], capture_output=True, text=True, timeout=timeout)


def one_line_refusal(out, message):
    assert out.returncode == 2, out.stderr[-2000:]
    assert message in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.parametrize("flags", [[], ["--fp16"]], ids=["fp32", "fp16"])
def test_sigkill_at_every_file_system_step_of_checkpoints_and_resume(world, flags):
    # --fp16: the loss scale starts at 2^30 and comes down within the run; a resume that did not restore it would
    # skip other steps and log another ppo/loss_scale
    out = subprocess.run([sys.executable, "tests/kill_points.py", *flags], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["kill_points"] >= 60 and result["failed"] == []


@pytest.fixture(scope="module")
def straight(world):
    shutil.rmtree("runs/test_rel_straight", ignore_errors=True)
    out = cli("--run-name", "test_rel_straight", *FLAGS)
    assert out.returncode == 0, out.stderr[-2000:]
    return "test_rel_straight"


def copy_run(src, dst):
    shutil.rmtree(f"runs/{dst}", ignore_errors=True)
    shutil.copytree(f"runs/{src}", f"runs/{dst}")
    return f"runs/{dst}/checkpoints"


@pytest.mark.parametrize("damage", ["flipped_byte", "cut_weights", "missing_state", "empty_state"])
def test_a_damaged_newest_checkpoint_gives_way_to_the_one_before(straight, damage):
    run = f"test_damaged_{damage}"
    root = copy_run(straight, run)
    for name in ("policy", "critic"):
        shutil.rmtree(f"runs/{run}/{name}")  # as if killed after the checkpoint at 6
    weights = f"{root}/step_6/shards/__0_0.distcp"  # the weights' and AdamW states' shards
    if damage == "flipped_byte":  # bit rot: the file loads, the weights are wrong
        data = bytearray(open(weights, "rb").read())
        data[-100] ^= 0x10
        open(weights, "wb").write(bytes(data))
    elif damage == "cut_weights":
        os.truncate(weights, os.path.getsize(weights) // 2)
    elif damage == "missing_state":
        os.remove(f"{root}/step_6/state.pt")
    else:
        open(f"{root}/step_6/state.pt", "wb").close()
    out = cli("--run-name", run, *FLAGS, "--resume", "auto")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "step_6 is damaged" in out.stdout and "--resume auto: runs/" + run + "/checkpoints/step_3" in out.stdout
    assert rows(run) == rows(straight)  # rows 4-6 redone from step_3, bit for bit


def test_explicit_resume_of_a_damaged_checkpoint_is_refused(straight):
    root = copy_run(straight, "test_damaged_explicit")
    os.remove(f"{root}/step_3/shards/.metadata")
    one_line_refusal(cli("--run-name", "test_damaged_explicit", *FLAGS, "--resume", f"{root}/step_3"),
                     "is not a whole checkpoint (shards/.metadata is missing)")


def test_resume_refuses_changed_flags_and_allows_a_longer_run(straight):
    copy_run(straight, "test_changed")
    out = cli("--run-name", "test_changed", *FLAGS, "--resume", "auto", "--learning-rate", "1e-3", "--kl-coef", "0.1")
    one_line_refusal(out, "was written with other flags (--kl-coef 0.05 -> 0.1; --learning-rate 0.0003 -> 0.001)")
    config = json.load(open("runs/test_changed/config.json"))
    assert config["learning_rate"] == 3e-4 and config["kl_coef"] == 0.05  # config.json untouched
    out = cli("--run-name", "test_changed", *FLAGS, "--resume", "auto", "--total-episodes", "448")
    assert out.returncode == 0, out.stderr[-2000:]
    assert [r["step"] for r in rows("test_changed")] == [1, 2, 3, 4, 5, 6, 7]
    assert json.load(open("runs/test_changed/config.json"))["total_episodes"] == 448


def test_explicit_resume_of_an_earlier_step_replaces_the_later_ones(straight):
    root = copy_run(straight, "test_branch")
    out = cli("--run-name", "test_branch", *FLAGS, "--resume", f"{root}/step_3")
    assert out.returncode == 0, out.stderr[-2000:]
    assert rows("test_branch") == rows(straight) and runfiles.checkpoint_damage(f"{root}/step_6") is None
    assert sorted(os.listdir(root)) == ["step_3", "step_6"]  # nothing left under another name


def test_two_processes_never_share_a_run(world):
    shutil.rmtree("runs/test_owner", ignore_errors=True)
    first = subprocess.Popen([sys.executable, "ppo.py", "--run-name", "test_owner", "--total-episodes", "6400",
                              "--save-every", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not os.path.exists("runs/test_owner/checkpoints/step_1") and time.time() < deadline:
            time.sleep(0.05)
        second = cli("--run-name", "test_owner", "--total-episodes", "6400")
        one_line_refusal(second, "runs/test_owner/ is in use by another process (pid")
        assert f"pid {first.pid} " in second.stderr
        resumed = cli("--run-name", "test_owner", "--total-episodes", "6400", "--save-every", "1", "--resume", "auto")
        one_line_refusal(resumed, "is in use by another process")
    finally:
        first.kill()
        first.wait()
    steps = [r["step"] for r in rows("test_owner")]
    assert steps == list(range(1, len(steps) + 1))  # each step once


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_finishes_the_update_checkpoints_and_says_how_to_continue(straight, sig, code):
    run = f"test_signal_{sig.name}"
    shutil.rmtree(f"runs/{run}", ignore_errors=True)
    proc = subprocess.Popen([sys.executable, "ppo.py", "--run-name", run, *FLAGS[:-4], "--save-every", "100",
                             "--sample-every", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (os.path.exists(f"runs/{run}/metrics.jsonl") and open(f"runs/{run}/metrics.jsonl").read()) \
            and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"stopped: {sig.name} after update ") and "--resume auto" in last and "Traceback" not in err
    step = int(last.split("after update ")[1].split(":")[0])
    assert os.path.exists(f"runs/{run}/checkpoints/step_{step}") and step < 6
    out = cli("--run-name", run, *FLAGS[:-4], "--save-every", "100", "--sample-every", "1", "--resume", "auto")
    assert out.returncode == 0, out.stderr[-2000:]
    assert rows(run) == rows(straight) and rows(run, "samples.jsonl") == rows(straight, "samples.jsonl")


def test_a_full_disk_is_named_and_leaves_no_partial_checkpoint(world, monkeypatch):
    shutil.rmtree("runs/test_full_disk", ignore_errors=True)

    def full(*a, **kw):  # what torch's zip writer raises when the device is full
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1234 vs 1200")
    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(ppo.UsageError, match="checkpoint of update 1 .* no space left on the device"):
        ppo.main(ppo.Args(run_name="test_full_disk", **dict(QUICK, save_every=1)))
    assert os.listdir("runs/test_full_disk/checkpoints") == []  # the partial .tmp is gone


def test_a_run_that_died_before_its_first_update_does_not_block_its_name(world):
    shutil.rmtree("runs/test_early_death", ignore_errors=True)
    os.makedirs("runs/test_early_death")
    open("runs/test_early_death/metrics.jsonl", "w").close()  # opened, never written
    ppo.main(ppo.Args(run_name="test_early_death", **QUICK))
    assert [r["step"] for r in rows("test_early_death")] == [1, 2]


@pytest.mark.parametrize("name", ["toy", "smollm2", "../escape", "/tmp/abs", "a/b", ""])
def test_run_names_are_names(world, name):
    with pytest.raises(ppo.UsageError, match="must be a plain name"):
        ppo.check_args(ppo.Args(run_name=name), 1)


BAD_FLAGS = [
    ("batch_size", 0), ("num_minibatches", 0), ("num_ppo_epochs", 0), ("learning_rate", -1.0),
    ("learning_rate", 1e39), ("critic_learning_rate", 0.0), ("seed", -1), ("seed", 2**32), ("eval_fraction", 1.0),
    ("gamma", 2.0), ("lam", 1.5), ("critic_lam", -0.1), ("clip_eps", -0.1), ("kl_coef", float("nan")),
    ("kl_coef", float("inf")), ("max_nonfinite_steps", 0), ("keep_checkpoints", 0), ("save_every", -1),
    ("micro_batch_size", 0), ("group_size", 0), ("dual_clip", 0.5), ("value_clip_eps", 0.0), ("top_p", 0.0),
    ("temperature", float("inf")), ("vf_coef", -1.0), ("max_grad_norm", -1.0), ("target_kl", 0.0),
    ("kl_target", -1.0), ("ratio_check_tol", 0.0), ("eval_size", 0), ("missing_eos_penalty", float("nan")),
    ("rollout_correction_high", -1.0), ("cispo_cap", 0.5), ("eval_samples", 0),
    ("pass_threshold", float("nan")), ("vllm_gpu_memory_utilization", 1.5), ("keep_best", "eval/score"),
]


@pytest.mark.parametrize("flag, value", BAD_FLAGS)
def test_every_flag_with_a_range_is_checked(flag, value):
    with pytest.raises(ppo.UsageError, match="--" + flag.replace("_", "-")):
        ppo.check_args(ppo.Args(**{flag: value}), 1)


def test_refusals_before_the_first_update_write_nothing(world):
    shutil.rmtree("runs/test_nothing", ignore_errors=True)
    for flags in (["--batch-size", "0"], ["--dataset", "no/such/file.csv"]):
        one_line_refusal(cli("--run-name", "test_nothing", "--total-episodes", "64", *flags), "")
    assert not os.path.exists("runs/test_nothing")


def test_track_without_credentials_is_refused_before_anything_loads(monkeypatch, tmp_path):
    for var in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    with pytest.raises(ppo.UsageError, match="--track needs wandb credentials"):
        ppo.check_args(ppo.Args(track=True), 1)


def test_keep_best_naming_a_metric_that_never_exists(world):
    shutil.rmtree("runs/test_best_typo", ignore_errors=True)
    with pytest.raises(ppo.UsageError, match="--keep-best 'objective/scroes' is not a metric of this run"):
        ppo.main(ppo.Args(run_name="test_best_typo", keep_best="objective/scroes", **QUICK))


REWARD_FILE = '''
def wrong_length(prompts, responses):
    return [1.0] * (len(responses) - 1)
def bare_float(prompts, responses):
    return 1.0
def one_value(prompts, responses):
    return [1.0]
def strings(prompts, responses):
    return ["1"] * len(responses)
def nones(prompts, responses):
    return None
def nested(prompts, responses):
    return [[1.0]] * len(responses)
def one_nan(prompts, responses):
    return [float("nan")] + [1.0] * (len(responses) - 1)
def wrong_signature(responses):
    return [1.0] * len(responses)
not_callable = 3
def bools(prompts, responses):
    return [r.endswith(".") for r in responses]
'''


@pytest.mark.parametrize("name, message", [
    ("wrong_length", "returned 15 values for 16 responses"), ("bare_float", "returned a float for 16 responses"),
    ("one_value", "returned 1 values for 16 responses"), ("strings", "returned '1' for response 0"),
    ("nones", "returned a NoneType"), ("nested", "returned [1.0] for response 0"),
    ("one_nan", "returned nan for response 0 (1 of 16 are not finite numbers)"),
    ("wrong_signature", "raised TypeError"), ("not_callable", "is a int, not a function"),
])
def test_a_misbehaving_reward_function_gets_one_line(world, tmp_path, name, message):
    (tmp_path / "rewards.py").write_text(REWARD_FILE)
    shutil.rmtree("runs/test_bad_reward", ignore_errors=True)
    with pytest.raises(ppo.UsageError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")
                       .replace("[", r"\[").replace("]", r"\]")):
        ppo.main(ppo.Args(run_name="test_bad_reward", reward_fn=f"{tmp_path}/rewards.py:{name}", **QUICK))


def test_a_reward_file_with_a_syntax_error_and_a_bool_reward(world, tmp_path):
    (tmp_path / "broken.py").write_text("def f(prompts, responses):\n    return [1.0 for r in responses\n")
    with pytest.raises(ppo.UsageError, match="cannot be loaded \\(SyntaxError"):
        ppo.load_python(f"{tmp_path}/broken.py:f", "--reward-fn")
    (tmp_path / "rewards.py").write_text(REWARD_FILE)
    shutil.rmtree("runs/test_bool_reward", ignore_errors=True)  # True / False are 1 / 0
    ppo.main(ppo.Args(run_name="test_bool_reward", reward_fn=f"{tmp_path}/rewards.py:bools", **QUICK))
    assert len(rows("test_bool_reward")) == 2


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "hi"}\n{"prompt": null}\n', "row 1 ('prompt') is None"),
    ('{"prompt": 3}\n', "row 0 ('prompt') is 3"),
    ('{"prompt": [{"content": "hi"}]}\n', "has the chat message {'content': 'hi'}"),
    ('{"prompt": []}\n', "row 0 ('prompt') is []"),
    ('{"prompt": [{"role": "user", "content": "hi"}]}\n', "the tokenizer has no chat template"),
])
def test_bad_dataset_rows_get_one_line(world, tmp_path, content, message):
    (tmp_path / "prompts.jsonl").write_text(content)
    shutil.rmtree("runs/test_bad_rows", ignore_errors=True)
    with pytest.raises(ppo.UsageError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]").replace("{", r"\{").replace("}", r"\}")):
        ppo.main(ppo.Args(run_name="test_bad_rows", dataset=str(tmp_path / "prompts.jsonl"), eval_fraction=0.0,
                          **QUICK))
    assert not os.path.exists("runs/test_bad_rows")


def test_an_empty_prompt_with_a_tokenizer_that_adds_no_bos(tmp_path):
    from transformers import AutoTokenizer
    import real_models
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "hi"}\n{"prompt": ""}\n')
    tok = AutoTokenizer.from_pretrained(real_models.tokenizer_dir("qwen2"))  # no BOS: "" is no token at all
    with pytest.raises(ppo.UsageError, match="row 1: the prompt gives no tokens"):
        ppo.load_prompts(ppo.Args(dataset=str(tmp_path / "prompts.jsonl"), eval_fraction=0.0), tok, print)


def test_non_utf8_and_csv_datasets(world, tmp_path):
    (tmp_path / "bad.jsonl").write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(ppo.UsageError, match="cannot be loaded"):
        ppo.load_prompt_rows(ppo.Args(dataset=str(tmp_path / "bad.jsonl")))
    (tmp_path / "prompts.csv").write_text("prompt,answer\nthe movie was,good\nthe film is,fine\n")
    train, _ = ppo.load_prompt_rows(ppo.Args(dataset=str(tmp_path / "prompts.csv"), eval_fraction=0.0))
    assert [r["prompt"] for r in train] == ["the movie was", "the film is"] and train[0]["answer"] == "good"


def test_non_finite_metrics_are_written_as_null():
    assert json.loads(ppo.json_line({"a": float("nan"), "b": float("inf"), "c": 1.5})) == {"a": None, "b": None,
                                                                                          "c": 1.5}


def test_an_unknown_estimator_fails_loudly():
    """`ppo.Args(...)` takes any string where tyro refuses it: check_args names the estimators, and the group
    baseline refuses a name it has no formula for instead of running another estimator's."""
    with pytest.raises(ppo.UsageError, match="--adv-estimator 'reinforce' is not one of gae, grpo, rloo"):
        ppo.check_args(ppo.Args(adv_estimator="reinforce", group_size=4), 1)
    with pytest.raises(ValueError, match="no group advantage is defined for --adv-estimator 'gae'"):
        ppo.group_advantages(torch.zeros(8), 4, "gae")
