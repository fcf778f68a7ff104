"""Real prompts and rewards: a JSON-lines dataset with chat templates, a Python reward function with an
extra column, a reward model with its own tokenizer, the two mixed with weights, and evaluation."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, LlamaConfig,
                          PreTrainedTokenizerFast)

import toy


def gold_gain_beyond_noise(gold, k=10, batch=64):
    """The toy world learned: the mean gold of the last k updates is above the first by more than three standard
    errors of sampling noise (an update's gold is a mean of `batch` responses in [0, 1], standard error <= 0.5 /
    sqrt(batch), so the difference's is <= that * sqrt(1 + 1 / k)). The level reached moves with the world each CPU
    trains and with the packages' numerics (0.32 -> 0.76 on 2026-12-04's, 0.25 -> 0.97 on 2026-12-06's)."""
    return sum(gold[-k:]) / k - gold[0] > 3 * 0.5 / batch ** 0.5 * (1 + 1 / k) ** 0.5


CHAT = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant :{% endif %}")
REWARD_FN = '''
def reward(prompts, responses, answer):
    """1 when the response mentions the reference adjective of its row, else 0."""
    assert len(prompts) == len(responses) == len(answer)
    return [float(a in r.split()) for r, a in zip(responses, answer)]
'''


def run(name, *flags):
    shutil.rmtree(f"runs/{name}", ignore_errors=True)
    out = subprocess.run([sys.executable, "ppo.py", "--run-name", name, *flags], capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return out, [json.loads(line) for line in open(f"runs/{name}/metrics.jsonl")]


@pytest.fixture(scope="module")
def files(world, tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    # the toy policy with a chat template ("user : ... assistant :")
    tok = AutoTokenizer.from_pretrained(world[0])
    tok.chat_template = CHAT
    tok.save_pretrained(root / "chat_policy")
    AutoModelForCausalLM.from_pretrained(world[0]).save_pretrained(root / "chat_policy")
    # prompts as chat messages, with a reference answer column
    noun = lambda p: next(w for w in p.split() if w in toy.NOUNS)  # noqa: E731
    rows = [{"prompt": [{"role": "user", "content": p}], "answer": toy.POSITIVE[toy.NOUNS.index(noun(p))]}
            for p in toy.prompts(300, seed=7)]  # the answer is a function of the prompt
    with open(root / "prompts.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    (root / "my_reward.py").write_text(REWARD_FN)
    # a reward model with a different tokenizer: the same words in another order, and its own chat template
    vocab = toy.SPECIALS + sorted(set(toy.VOCAB) - set(toy.SPECIALS) | {"user", "assistant"}, reverse=True)
    wl = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    wl.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    rm_tok = PreTrainedTokenizerFast(tokenizer_object=wl, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    rm_tok.chat_template = CHAT
    rm_tok.save_pretrained(root / "other_rm")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    AutoModelForSequenceClassification.from_config(cfg).save_pretrained(root / "other_rm")
    return root


def test_chat_dataset_reward_fn_with_column_and_eval(files, world):
    out, rows = run("test_data", "--model", str(files / "chat_policy"), "--dataset", str(files / "prompts.jsonl"),
                    "--reward-fn", f"{files}/my_reward.py:reward", "--total-episodes", "128", "--eval-every", "1",
                    "--eval-fraction", "0.1", "--keep-best", "eval/score", "--critic-model", world[1])
    assert "critic" in os.listdir("runs/test_data")
    for r in rows:
        assert 0 <= r["objective/reward_fn"] <= 1 and "objective/reward_model" not in r
        assert {"eval/score", "eval/reward_fn"} <= set(r)
    samples = [json.loads(line) for line in open("runs/test_data/eval_samples.jsonl")]
    assert {s["step"] for s in samples} == {1, 2} and isinstance(samples[0]["prompt"], list)
    assert os.path.exists("runs/test_data/best/policy/model.safetensors")


def test_reward_model_with_its_own_tokenizer_mixed_with_a_function(files, world):
    out, rows = run("test_other_rm", "--model", str(files / "chat_policy"), "--dataset", str(files / "prompts.jsonl"),
                    "--reward-model", str(files / "other_rm"), "--reward-model-weight", "0.5",
                    "--reward-fn", f"{files}/my_reward.py:reward", "--reward-fn-weight", "2.0",
                    "--missing-eos-penalty", "None", "--total-episodes", "128", "--sample-every", "1")
    assert "its own tokenizer" in out.stdout
    assert all("objective/reward_model" in r and "objective/reward_fn" in r for r in rows)
    # every logged score equals 0.5 x the RM on the rendered text (its own template and tokens) + 2 x the function
    rm = AutoModelForSequenceClassification.from_pretrained(files / "other_rm").eval()
    rm_tok = AutoTokenizer.from_pretrained(files / "other_rm")
    answers = {json.dumps(json.loads(line)["prompt"]): json.loads(line)["answer"]
               for line in open(files / "prompts.jsonl")}
    samples = [json.loads(line) for line in open("runs/test_other_rm/samples.jsonl")]
    assert len(samples) == 8
    for s in samples:
        text = rm_tok.apply_chat_template(s["prompt"] + [{"role": "assistant", "content": s["response"]}], tokenize=False)
        with torch.no_grad():
            direct = rm(**rm_tok(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item()
        fn = float(answers[json.dumps(s["prompt"])] in s["response"].split())
        assert abs(s["score"] - (0.5 * direct + 2.0 * fn)) < 1e-4, (s, direct, fn)


def test_gold_as_the_reward_function_trains_the_toy_world(world):
    out, rows = run("test_gold_fn", "--reward-fn", "toy:gold_reward")
    assert all("objective/reward_model" not in r for r in rows)  # no reward model was loaded
    gold = [r["objective/gold"] for r in rows]
    assert gold[0] <= 0.5 and gold_gain_beyond_noise(gold, k=len(gold) // 10), gold


RGYM = dict(dataset="reasoning-gym:chain_sum", dataset_options='{"size": 64, "max_terms": 2, "max_digits": 1}',
            eval_size=16)


@pytest.mark.mutants  # (a minute: outside the fast subset; the mutation check runs it)
def test_a_renamed_copy_trains_on_a_reasoning_gym_task_with_its_own_reward(tmp_path):
    """`cp ppo.py ppo_idea.py`, as --exp-name's help invites, in a folder of its own with gae.py and adapters.py:
    the copy's default reward is adapters.py's (nothing names the module `ppo`), its runs log under the copy's name."""
    import real_models
    model = real_models.build("qwen2")  # a chat model on a real tokenizer (before the copy: it is built here)
    for name in ("gae.py", "adapters.py", "runfiles.py", "asyncsampler.py"):
        shutil.copy(name, tmp_path)
    shutil.copy("ppo.py", tmp_path / "ppo_idea.py")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "ppo_idea.py", "--model", model, "--dataset", RGYM["dataset"],
                          "--dataset-options", RGYM["dataset_options"], "--eval-size", "16", "--adv-estimator", "grpo",
                          "--group-size", "4", "--batch-size", "8", "--total-episodes", "8", "--num-ppo-epochs", "1",
                          "--response-length", "8", "--save-every", "0", "--run-name", "renamed"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    config = json.load(open(tmp_path / "runs/renamed/config.json"))
    assert config["reward_fn"] == "reasoning-gym" and config["exp_name"] == "ppo_idea"
    row = json.loads(open(tmp_path / "runs/renamed/metrics.jsonl").readline())
    assert 0 <= row["objective/reward_fn"] <= 1


@pytest.mark.fast
@pytest.mark.parametrize("answer_format", ["tag", "raw", "number"])
def test_a_reasoning_gym_task_gives_prompts_and_its_own_reward(answer_format):
    import ppo
    import reasoning_gym
    args = ppo.Args(**RGYM, answer_format=answer_format)
    ppo.check_args(args, 1)
    assert args.reward_fn == "reasoning-gym"
    train, held_out = ppo.load_prompt_rows(args)
    assert len(held_out) == 16
    ask = ppo.adapters.ANSWER_FORMATS[answer_format]
    assert all(r["prompt"][0]["role"] == "user" and r["prompt"][0]["content"].endswith(ask) for r in train)
    # the library's own rows (seed 1234), those of the evaluation's questions left out; its own scorer
    own = reasoning_gym.create_dataset("chain_sum", size=64, seed=1234, max_terms=2, max_digits=1)
    asked = {r["entry"]["question"] for r in held_out}
    assert [r["entry"]["question"] for r in train] == [e["question"] for e in own if e["question"] not in asked]
    rows = train[:4]
    right = [r["answer"] for r in rows]
    wrong = [str(int(a) + 1) for a in right]
    if answer_format == "tag":  # the last tag counts; an answer outside any tag does not
        texts = [f"<answer>{wrong[0]}</answer> no, <answer>{right[0]}</answer>", f"<answer> {right[1]} </answer>",
                 right[2], f"<answer>{wrong[3]}</answer>"]
    elif answer_format == "raw":
        texts = [right[0], f" {right[1]}\n", wrong[2], ""]  # the whole response, stripped
    else:  # the last number, a sign included
        texts = [f"{wrong[0]}, no: it is {right[0]}.", f"= {right[1]}", f"{right[2]} or {wrong[2]}", "none"]
    reward = ppo.load_python(args.reward_fn, "--reward-fn")
    columns = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}
    assert reward([r["prompt"] for r in rows], texts, **columns) == [1.0, 1.0, 0.0, 0.0]


# the docs' tasks (gcd and chain_sum, with its options) and three it does not use, at the default 2,048 rows
HELD_OUT_TASKS = [("gcd", {"max_value": 20}), ("chain_sum", {"min_terms": 2, "max_terms": 2, "max_digits": 1}),
                  ("basic_arithmetic", {}), ("leg_counting", {}), ("spell_backward", {})]


@pytest.mark.fast
@pytest.mark.parametrize("task, options", HELD_OUT_TASKS)
def test_no_evaluation_question_is_a_training_question(task, options):
    """reasoning-gym builds item i from Random(seed + i): evaluation rows from seed + 1 were training rows shifted by
    one. Now no evaluation question is among the rows a run can draw, and --eval-size of them are evaluated."""
    import ppo
    args = ppo.Args(dataset=f"reasoning-gym:{task}", dataset_options=json.dumps(options), eval_size=32, eval_every=5)
    train, held_out = ppo.load_prompt_rows(args)
    asked = [r["entry"]["question"] for r in held_out]
    assert len(set(asked)) == len(asked) == 32
    assert not set(asked) & {r["entry"]["question"] for r in train}
    assert len(train) >= 2048 * 0.8  # a few questions' rows left out, not the task


@pytest.mark.fast
def test_a_small_space_keeps_a_share_for_each_and_says_so():
    import ppo
    said = []
    args = ppo.Args(dataset="reasoning-gym:gcd", dataset_options='{"min_value": 1, "max_value": 4}', eval_size=32,
                    eval_every=1)  # 16 questions in all
    train, held_out = ppo.load_prompt_rows(args, log=said.append)
    questions = {r["entry"]["question"] for r in train}
    assert len(held_out) == 8 and len(questions) == 8 and not questions & {r["entry"]["question"] for r in held_out}
    assert len(said) == 1 and "8 distinct evaluation questions, fewer than --eval-size 32" in said[0]
    said.clear()  # without evaluation nothing is said, and the training rows are the same
    assert ppo.load_prompt_rows(ppo.Args(**dict(vars(args), eval_every=0)), log=said.append)[0] == train and not said


@pytest.mark.fast
def test_the_chain_world_and_a_file_split_by_question(tmp_path, world):
    import ppo
    train, held_out = ppo.load_prompt_rows(ppo.Args(model="chain", eval_size=64))
    assert len(held_out) == 64 and not {r["prompt"] for r in held_out} & {r["prompt"] for r in train}
    rows = [{"prompt": f"{a} + {b} =", "answer": a + b} for a in range(10) for b in range(10)] * 20  # 100 prompts
    with open(tmp_path / "sums.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in np.random.default_rng(0).permutation(rows).tolist())
    train, held_out = ppo.load_prompt_rows(ppo.Args(dataset=str(tmp_path / "sums.jsonl"), eval_fraction=0.1))
    asked = [r["prompt"] for r in held_out]
    assert len(set(asked)) == len(asked) == 10 and len(train) == 2000 - 10 * 20
    assert not set(asked) & {r["prompt"] for r in train}
    # the toy world is closed (32 prompts): its evaluation prompts are training prompts, as the docs say
    train, held_out = ppo.load_prompt_rows(ppo.Args(eval_size=8))
    assert len(held_out) == 8 and {r["prompt"] for r in held_out} <= {r["prompt"] for r in train}


@pytest.mark.fast
def test_evaluation_without_evaluation_prompts_is_refused(tmp_path, world):
    import ppo
    from transformers import AutoTokenizer
    with open(tmp_path / "one.jsonl", "w") as f:
        f.writelines(json.dumps({"prompt": "the movie was"}) + "\n" for _ in range(8))  # one prompt, 8 rows
    tok = AutoTokenizer.from_pretrained(world[0], padding_side="left")
    with pytest.raises(ppo.UsageError, match="0 evaluation prompts for 1 rank"):
        ppo.load_prompts(ppo.Args(dataset=str(tmp_path / "one.jsonl"), eval_every=1), tok, print)


@pytest.mark.fast
@pytest.mark.parametrize("flags, message", [
    (dict(dataset="reasoning-gym:no_such_task"), "cannot be generated .*not registered"),
    (dict(dataset="reasoning-gym:chain_sum", dataset_options='{"bogus": 1}'), "cannot be generated .*bogus"),
    (dict(dataset="reasoning-gym:chain_sum", dataset_options="[1, 2]"), "not a JSON object"),
    (dict(dataset="reasoning-gym:chain_sum", dataset_options="{max_terms: 2}"), "not a JSON object"),
])
def test_a_bad_reasoning_gym_task_is_one_line(flags, message):
    import ppo
    with pytest.raises(ppo.UsageError, match=message):
        ppo.load_prompt_rows(ppo.Args(**flags))


@pytest.mark.fast
def test_the_number_format_reads_thousands_separators():
    import ppo
    import reasoning_gym
    entry = dict(reasoning_gym.create_dataset("chain_sum", size=1, seed=1)[0], answer="1024")
    texts = ["It is 1,024.", "so 1,02", "gcd(12,18): 1024", "1,024 and then 7"]
    scores = ppo.adapters.reasoning_gym_reward(None, texts, ["chain_sum"] * 4, [entry] * 4, ["number"] * 4)
    assert scores == [1, 0, 1, 0]


@pytest.mark.fast
def test_reasoning_gym_flags_without_the_dataset_are_refused():
    import ppo
    for flags in (dict(dataset_options="{}"), dict(answer_format="raw")):
        with pytest.raises(ppo.UsageError, match="are for --dataset reasoning-gym:NAME"):
            ppo.check_args(ppo.Args(**flags), 1)
