"""Every bad input gets one line that says what is wrong and what to do, exit status 2, no traceback."""
import os
import shutil
import subprocess
import sys

import pytest
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer


def run(*flags):
    shutil.rmtree("runs/test_bad", ignore_errors=True)
    return subprocess.run([sys.executable, "ppo.py", "--run-name", "test_bad", "--total-episodes", "64", *flags],
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def odd_checkpoints(world, tmp_path_factory):
    """A sequence classifier passed as a policy, and a reward model with two outputs."""
    policy_path, reward_path = world
    root = tmp_path_factory.mktemp("odd")
    AutoModelForSequenceClassification.from_pretrained(reward_path).save_pretrained(root / "classifier")
    two = AutoModelForSequenceClassification.from_pretrained(reward_path, num_labels=2, ignore_mismatched_sizes=True)
    two.save_pretrained(root / "two_labels")
    tok = AutoTokenizer.from_pretrained(policy_path)
    for name in ("classifier", "two_labels"):
        tok.save_pretrained(root / name)
    return root


@pytest.mark.parametrize("flags, message", [
    (["--model", "no/such/dir", "--reward-model", "no/such/dir"], "--model 'no/such/dir' cannot be loaded"),
    (["--temperature", "0"], "--temperature must be > 0"),
    (["--response-length", "0"], "--response-length and --max-prompt-length must be positive"),
    (["--kl-coef", "-0.1"], "--kl-coef must be >= 0"),
    (["--batch-size", "64", "--micro-batch-size", "48"], "must split into 1 rank(s) x --num-minibatches"),
    (["--top-p", "0.9"], "--top-p/--top-k make the sampled support differ"),
    (["--bootstrap-truncated"], "also pass --missing-eos-penalty None"),
    (["--max-prompt-length", "4"], "longer than --max-prompt-length 4 tokens"),
    (["--total-episodes", "10"], "less than one batch"),
    (["--resume", "runs/nowhere"], "is not a whole checkpoint (no such folder)"),
])
def test_bad_flag(world, flags, message):
    out = run(*flags)
    assert out.returncode == 2, out.stderr[-1000:]
    assert message in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_policy_that_is_not_a_causal_lm(odd_checkpoints, world):
    out = run("--model", str(odd_checkpoints / "classifier"), "--reward-model", world[1])
    assert out.returncode == 2 and "is a LlamaForSequenceClassification, not a causal language model" in out.stderr


def test_reward_model_without_one_scalar(odd_checkpoints):
    out = run("--reward-model", str(odd_checkpoints / "two_labels"))
    assert out.returncode == 2 and "must be a sequence classifier with one output" in out.stderr
    assert "with 2 labels" in out.stderr


def test_debug_shows_the_traceback(world):
    out = run("--temperature", "0", "--debug")
    assert out.returncode != 0 and "Traceback" in out.stderr and "UsageError" in out.stderr


def test_long_prompts_truncated_and_counted(world):
    out = run("--max-prompt-length", "5", "--truncate-prompts")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "truncated" in out.stdout and "prompts to their last 5 tokens" in out.stdout


def test_tokenizer_whose_pad_is_eos_pads_with_another_token(world, tmp_path):
    policy_path, reward_path = world
    for src, name in ((policy_path, "policy"), (reward_path, "reward")):
        cls = AutoModelForCausalLM if name == "policy" else AutoModelForSequenceClassification
        cls.from_pretrained(src).save_pretrained(tmp_path / name)
        tok = AutoTokenizer.from_pretrained(src)
        tok.pad_token = tok.eos_token  # pad == EOS, as many checkpoints ship
        tok.save_pretrained(tmp_path / name)
    out = run("--model", str(tmp_path / "policy"), "--reward-model", str(tmp_path / "reward"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("batches are padded with '<unk>'") == 1  # a token of the vocabulary, not EOS
    saved = AutoTokenizer.from_pretrained("runs/test_bad/policy")
    assert saved.pad_token == saved.eos_token  # the checkpoint's tokenizer, saved as it came
    assert len(saved) == len(AutoTokenizer.from_pretrained(policy_path))  # no token added...
    initial = AutoModelForCausalLM.from_pretrained(policy_path).get_input_embeddings().num_embeddings
    assert AutoModelForCausalLM.from_pretrained("runs/test_bad/policy").get_input_embeddings().num_embeddings == initial


def test_run_name_already_used(world):
    os.makedirs("runs/test_used", exist_ok=True)
    open("runs/test_used/metrics.jsonl", "w").write('{"step": 1}\n')
    out = subprocess.run([sys.executable, "ppo.py", "--run-name", "test_used", "--total-episodes", "64"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 2 and "already holds a run: continue it with --resume auto" in out.stderr
    assert open("runs/test_used/metrics.jsonl").read() == '{"step": 1}\n'  # nothing overwritten


def test_empty_prompt_set(world, tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    out = run("--dataset", str(tmp_path / "empty.jsonl"))
    assert out.returncode == 2 and "the prompt set is empty" in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.fast
@pytest.mark.parametrize("field, typo, known", [
    ("kl_estimator", "k4", "kl_penalty (k1, k2, k3, abs)"),
    ("loss_agg", "seq-mean", "loss_weights (token-mean, seq-mean-token-mean, seq-sum-norm)"),
    ("policy_loss", "grpo", "policy_objective (ppo, gspo, cispo)"),
    ("rollout_correction", "tokenmask", "rollout_correction (token-is, seq-is, icepop, token-mask, seq-mask, geo-mask"),
])
def test_a_name_that_no_branch_reads_fails_in_one_line_before_any_model_loads(field, typo, known, monkeypatch):
    """A fork that adds a name to a flag's choices and misspells it in the branch (or forgets the branch) gets one
    line naming the function and the names it knows, from check_args, not a silent fall-through to another case.
    (tyro refuses a name outside the Literal; a fork's new Literal, or ppo.Args from Python, reach check_args.)"""
    import ppo
    monkeypatch.setitem(ppo.ROLLOUT_CORRECTIONS, "tokenmask", ppo.ROLLOUT_CORRECTIONS["token-mask"])  # (its bounds)
    with pytest.raises(ppo.UsageError) as e:
        ppo.check_args(ppo.Args(**{field: typo}, sampler_precision="bf16"), 1)
    assert f"{typo!r} has no branch in {known}" in str(e.value) and "\n" not in str(e.value)


def test_a_forks_new_name_without_its_branch_is_refused_on_the_command_line(world, tmp_path):
    """The whole path a fork takes: k4 added to --kl-estimator's choices, no branch written: exit 2, one line."""
    for name in ("gae.py", "adapters.py", "runfiles.py", "asyncsampler.py", "toy.py"):
        shutil.copy(name, tmp_path)
    source = open("ppo.py").read().replace('kl_estimator: Opt(Literal["k1", "k2", "k3", "abs"])',
                                           'kl_estimator: Opt(Literal["k1", "k2", "k3", "abs", "k4"])')
    (tmp_path / "ppo_k4.py").write_text(source)
    out = subprocess.run([sys.executable, str(tmp_path / "ppo_k4.py"), "--kl-estimator", "k4", "--run-name",
                          "test_k4"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "error: --kl-estimator 'k4' has no branch in kl_penalty (k1, k2, k3, abs)"], out.stderr[-2000:]
    assert not os.path.exists("runs/test_k4")  # refused before anything was written
