"""Real tokenizers and chat templates (tests/real_models.py builds tiny policies on them): a response ends
where the chat model ends its turn, with HF generation and with vLLM; no token is added to a vocabulary
that lacks a pad; the saved policy keeps the checkpoint's tokenizer and generation config; resume after
a kill is exact with a reward model of another tokenizer that has no pad."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

import ppo
import real_models
from test_resume import kill_at_checkpoint

# the tokens each case's responses must be able to end with
STOPS = {"qwen2": {"<|im_end|>", "<|endoftext|>"}, "qwen2-base": {"<|endoftext|>", "<|im_end|>"},
         "llama": {"</s>"}, "mistral": {"</s>"}, "gpt2": {"<|endoftext|>"}}
REWARD_FN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "real_models.py") + ":reward"


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return str(real_models.write_prompts(tmp_path_factory.mktemp("real") / "prompts.jsonl"))


def flags(case, prompts, **extra):
    base = dict(model=real_models.build(case), dataset=prompts, reward_fn=REWARD_FN, total_episodes=16, batch_size=16,
                response_length=12, max_prompt_length=64, num_ppo_epochs=1, eval_fraction=0.0, sample_every=1,
                save_every=0)
    return dict(base, **extra)


def cli(d):
    out = []
    for k, v in d.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


@pytest.mark.parametrize("case", list(STOPS))
def test_responses_end_at_the_end_of_the_turn(case, prompts, capsys):
    path = real_models.build(case)
    shipped = AutoTokenizer.from_pretrained(path)
    shutil.rmtree(f"runs/test_real_{case}", ignore_errors=True)
    ppo.main(ppo.Args(run_name=f"test_real_{case}", **flags(case, prompts)))
    out = capsys.readouterr().out
    row = json.loads(open(f"runs/test_real_{case}/metrics.jsonl").readline())
    assert row["ppo/val/eos_rate"] >= 0.9, row["ppo/val/eos_rate"]  # the fine-tuned policy ends its turns
    assert row["ppo/policy/ratio_at_start"] < 1e-5 and row["objective/kl"] == 0.0
    stop_line = next(line for line in out.splitlines() if line.startswith("responses end at"))
    assert all(f"'{t}'" in stop_line for t in STOPS[case]), stop_line
    # the saved policy is the checkpoint's: its tokenizer (no pad added, no token added) and generation config
    saved = AutoTokenizer.from_pretrained(f"runs/test_real_{case}/policy")
    assert len(saved) == len(shipped) and saved.pad_token == shipped.pad_token and saved.eos_token == shipped.eos_token
    assert (GenerationConfig.from_pretrained(f"runs/test_real_{case}/policy").eos_token_id
            == GenerationConfig.from_pretrained(path).eos_token_id)
    cfg, saved_cfg = AutoConfig.from_pretrained(path), AutoConfig.from_pretrained(f"runs/test_real_{case}/policy")
    assert saved_cfg.vocab_size == cfg.vocab_size  # no resize


def test_stop_ids_come_from_the_checkpoint_or_the_flag():
    tok = AutoTokenizer.from_pretrained(real_models.build("qwen2-base"))
    gen = GenerationConfig.from_pretrained(real_models.build("qwen2-base"))
    ids = ppo.stop_token_ids(tok, gen)
    assert {tok.convert_ids_to_tokens(i) for i in ids} == {"<|endoftext|>", "<|im_end|>"}  # the template adds im_end
    assert ppo.stop_token_ids(tok, gen, ["<|im_end|>"]) == [tok.convert_tokens_to_ids("<|im_end|>")]
    with pytest.raises(ppo.UsageError, match="are not tokens of the policy's tokenizer"):
        ppo.stop_token_ids(tok, gen, ["<|no_such_token|>"])
    # the batch cut: the first of any stop id ends a row
    im_end, eot = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    responses = torch.tensor([[5, im_end, 7, 8], [5, 6, eot, 8], [5, 6, 7, 8]])
    assert ppo.response_lengths(responses, ids).tolist() == [2, 3, 4]


def run_ppo(name, *args, env=None):
    shutil.rmtree(f"runs/{name}", ignore_errors=True)
    return subprocess.run([sys.executable, "ppo.py", "--run-name", name, *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("case", ["qwen2-base", "gpt2"])  # Llama's tokenizer goes through vLLM with Gemma2 below
def test_vllm_stops_where_the_trainer_does(case, prompts):
    pytest.importorskip("vllm")
    out = run_ppo(f"test_real_vllm_{case}", "--vllm", *cli(flags(case, prompts)))
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads(open(f"runs/test_real_vllm_{case}/metrics.jsonl").readline())
    assert row["ppo/val/eos_rate"] >= 0.9, row["ppo/val/eos_rate"]
    assert row["rollout/logprob_diff_mean"] <= 1e-4, row["rollout/logprob_diff_mean"]  # the same rows, same ends


def test_vllm_takes_the_weights_of_a_tied_embedding_gemma2(prompts, tmp_path):
    # the push sends parameters, not the state dict: a tied lm_head.weight is the embedding's alias, and
    # vLLM's Gemma2 has no parameter of that name
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM, Gemma2Config
    tok = AutoTokenizer.from_pretrained(real_models.tokenizer_dir("llama"))
    cfg = Gemma2Config(vocab_size=len(tok), head_dim=32, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                       **{k: v for k, v in real_models.SMALL.items()})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    assert model.config.tie_word_embeddings and "lm_head.weight" in model.state_dict()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    out = run_ppo("test_real_gemma2", "--vllm", *cli(flags("llama", prompts, model=str(tmp_path), response_length=8,
                                                                total_episodes=32, learning_rate=1e-3)))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in open("runs/test_real_gemma2/metrics.jsonl")]
    assert len(rows) == 2 and all(r["rollout/logprob_diff_mean"] <= 1e-4 for r in rows)  # and after a push
    assert rows[1]["objective/kl"] > 1e-3  # the weights the push sent had moved


def test_vllm_refuses_an_architecture_it_would_patch_transformers_for(tmp_path):
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM, Olmo2Config
    path = real_models.tokenizer_dir("gpt2")
    tok = AutoTokenizer.from_pretrained(path)
    cfg = Olmo2Config(vocab_size=len(tok), bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=None, **real_models.SMALL)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    out = run_ppo("test_real_olmo2", "--vllm", "--model", str(tmp_path), "--reward-fn", REWARD_FN)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]  # vLLM's import prints a line of its own before it
    assert last.startswith("error: --vllm:") and "no implementation of its own for Olmo2ForCausalLM" in last
    assert not os.path.exists("runs/test_real_olmo2/metrics.jsonl")  # refused before any work


def test_sigkill_and_resume_with_a_chosen_pad_and_a_reward_model_of_another_tokenizer(prompts):
    # the llama tokenizer's pad is its EOS, so the run pads with <unk>; the reward model reads GPT-2's
    # tokens (no pad of its own): responses are decoded and re-tokenized for it
    common = cli(flags("llama", prompts, total_episodes=64, save_every=2, reward_fn=REWARD_FN)) + [
        "--reward-model", real_models.reward_model("gpt2"), "--reward-fn-weight", "0.5"]
    straight = run_ppo("test_real_straight", *common)
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert "padded with '<unk>'" in straight.stdout and "its own tokenizer" in straight.stdout
    kill_at_checkpoint("test_real_killed", common, 2)
    assert not os.path.exists("runs/test_real_killed/policy")
    resumed = subprocess.run([sys.executable, "ppo.py", "--run-name", "test_real_killed", *common, "--resume", "auto"],
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "padded with '<unk>'" in resumed.stdout and "its own tokenizer" in resumed.stdout  # decided the same way
    a, b = ([{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "mem/"))}
             for line in open(f"runs/{r}/metrics.jsonl")] for r in ("test_real_straight", "test_real_killed"))
    assert [r["step"] for r in b] == [1, 2, 3, 4] and a == b


def test_keep_sampling_mask_in_bf16_at_a_real_vocabulary(prompts):
    # bf16 rounds the rollout pass's logits apart from the sampler's, so a drawn token at the top-k boundary
    # can fall outside the support recomputed from them (old log-prob -inf, then NaN everywhere); at Qwen2's
    # vocabulary top-k 50 binds at every position (the toy's 42 tokens never let it). With the reference on the
    # same support, update 1 (policy = reference) has a KL of exactly 0.
    d = flags("qwen2", prompts, total_episodes=48, precision="bf16", top_k=50, micro_batch_size=8, sample_every=0)
    out = run_ppo("test_real_keep_mask_bf16", *cli(d), "--keep-sampling-mask")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in open("runs/test_real_keep_mask_bf16/metrics.jsonl")]
    assert len(rows) == 3 and rows[0]["objective/kl"] == 0
    assert all(r["ppo/policy/ratio_at_start"] < 1e-2 and r["ppo/skipped_steps"] == 0 for r in rows)
