"""LoRA (--lora-rank, peft): the reference is the policy's base with its adapters off, equal to a separately
loaded frozen copy before and after updates; the base never moves; only adapters and the value head have
optimizer states; the saved policy is the adapted one merged (W + scale * B A) and the adapter loads with
PeftModel.from_pretrained; a killed run resumes exactly from its adapters; bad input gets one line."""
import json
import os
import shutil

import pytest
import torch
from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, GPT2Config, LlamaConfig,
                          Qwen2Config)

import ppo
import toy
from fp32 import assert_close_fp32
from test_oracles import TOY_SUM
from test_sharded import checkpoint_contents

FLAGS = dict(lora_rank=8, learning_rate=1e-3, critic_learning_rate=1e-3, total_episodes=3 * 64, save_every=1,
             sample_every=0)


@pytest.fixture(scope="module")
def lora_run():
    """Three in-process updates of the toy world with rank-8 adapters: the rollouts, and the models and
    optimizers as the run left them."""
    seen, kept = [], {}
    real_backward, real_load, real_save = ppo.minibatch_backward, ppo.load_models, ppo.save_models

    def load(*a, **k):
        kept["models"] = real_load(*a, **k)
        return kept["models"]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ppo, "minibatch_backward", lambda policy, critic, rollout, *a, **k: (
            seen.append(rollout), real_backward(policy, critic, rollout, *a, **k))[1])
        m.setattr(ppo, "load_models", load)
        shutil.rmtree("runs/test_lora", ignore_errors=True)
        ppo.main(ppo.Args(run_name="test_lora", **FLAGS))
    firsts = [r for i, r in enumerate(seen) if i == 0 or r is not seen[i - 1]]  # one rollout per update
    return firsts, kept["models"]


def frozen_copy():
    return AutoModelForCausalLM.from_pretrained(toy.build_world()[0], dtype=torch.float32).eval()


@pytest.mark.fast
def test_the_reference_is_the_base_with_the_adapters_off(lora_run):
    rollouts, models = lora_run
    frozen = frozen_copy()
    P = rollouts[0].query_responses.shape[1] - rollouts[0].mask.shape[1]
    for rollout in rollouts:  # update 1 (adapters at B = 0) and the later ones (adapters trained)
        with torch.no_grad():
            expected = ppo.policy_logprobs(frozen, rollout.query_responses, rollout.attention_mask, P, 0.7)[0]
        assert_close_fp32(rollout.ref_logprobs * rollout.mask, expected * rollout.mask, TOY_SUM)  # (other shapes)
    last = rollouts[-1]
    assert ((last.logprobs - last.ref_logprobs).abs() * last.mask).max() > 1e-2  # the adapters did move the policy
    # the base never moves: every frozen weight is the checkpoint's, bit for bit
    base = {k.replace(".base_layer.", "."): v for k, v in models.policy.state_dict().items() if ".lora_" not in k}
    assert base.keys() == frozen.state_dict().keys()
    assert all(torch.equal(v, frozen.state_dict()[k]) for k, v in base.items())
    assert models.policy.peft_config["default"].lora_dropout == 0.0
    assert not isinstance(models.ref_policy, type(models.policy))  # no second copy was loaded


@pytest.mark.fast
def test_only_the_adapters_and_the_value_head_have_optimizer_states(lora_run):
    _, models = lora_run
    step = "runs/test_lora/checkpoints/step_3"
    whole = checkpoint_contents(step)
    policy_opt, critic_opt = whole["policy_adamw"]["state"], whole["critic_adamw"]["state"]
    lora = lambda m: [n for n, _ in m.named_parameters() if ".lora_" in n]  # noqa: E731
    assert len(policy_opt) == len(lora(models.policy)) > 0
    head = [n for n, _ in models.critic.seq_cls.score.named_parameters()]
    assert len(critic_opt) == len(lora(models.critic.seq_cls)) + len(head)
    # a checkpoint is small: the adapters, the value head and their states; resume reads the bases from --model
    assert set(whole["policy"]) == set(policy_opt) and set(whole["critic"]) == set(critic_opt)
    assert sorted(os.listdir(step)) == ["flags.json", "manifest.json", "shards", "state.pt"]


@pytest.mark.fast
def test_the_saved_policy_is_the_adapted_one_merged(lora_run):
    from peft import PeftModel
    rollouts, models = lora_run
    ids, am = rollouts[-1].query_responses, rollouts[-1].attention_mask
    with torch.no_grad():
        adapted = ppo.forward(models.policy, ids, am).logits
        merged = ppo.forward(AutoModelForCausalLM.from_pretrained("runs/test_lora/policy").eval(), ids, am).logits
        peft = PeftModel.from_pretrained(frozen_copy(), "runs/test_lora/policy_adapter").eval()
        from_peft = ppo.forward(peft, ids, am).logits
        values = models.critic(**dict(input_ids=ids, attention_mask=am, position_ids=(am.cumsum(1) - 1).clamp(min=0)))
        saved = ppo.ValueModel(AutoModelForSequenceClassification.from_pretrained("runs/test_lora/critic").eval())
        saved_values = saved(input_ids=ids, attention_mask=am, position_ids=(am.cumsum(1) - 1).clamp(min=0))
    # W x + s B (A x) and (W + s B A) x round differently; how far apart fp32 lets them be grows with the
    # longest sum and the logits' size (tests/fp32.py: 1.2e-5 on logits near 4 was seen on CI's CPU)
    real = am.bool()  # (the run's policy packs its rows: nothing is computed on padding, which no pass reads)
    assert_close_fp32(merged[real], adapted[real], TOY_SUM)
    assert_close_fp32(from_peft[real], adapted[real], TOY_SUM)
    assert_close_fp32(saved_values, values, TOY_SUM)


def test_a_killed_lora_run_resumes_exactly():
    from test_resume import straight_and_resumed
    runs = straight_and_resumed("test_lora", ["--lora-rank", "4", "--learning-rate", "1e-3", "--total-episodes", "192",
                                              "--save-every", "1"])
    rows = [[{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "mem/"))}
             for line in open(f"runs/{run}/metrics.jsonl")] for run in runs]
    assert len(rows[0]) == 3 and rows[0] == rows[1]


@pytest.mark.mutants  # outside the fast subset for its time; the mutation check runs it
def test_bf16_bases_change_no_number_under_bf16_autocast(world):
    # --lora-base-dtype bf16: autocast rounds each linear layer's weights to bf16 before its matmul anyway, so
    # the run's rows are those of fp32 bases, bit for bit; only the adapted layers' W and bias are bf16
    kept, rows = {}, {}
    real_load = ppo.load_models
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ppo, "load_models", lambda *a, **k: kept.setdefault("models", real_load(*a, **k)))
        for dtype in ("fp32", "bf16"):
            kept.clear()
            shutil.rmtree(f"runs/test_lora_{dtype}", ignore_errors=True)
            ppo.main(ppo.Args(run_name=f"test_lora_{dtype}", precision="bf16", lora_base_dtype=dtype,
                              **{**FLAGS, "save_every": 0}))
            rows[dtype] = [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "mem/"))}
                           for line in open(f"runs/test_lora_{dtype}/metrics.jsonl")]
    assert len(rows["bf16"]) == 3 and rows["bf16"] == rows["fp32"]
    assert rows["bf16"][-1]["objective/kl"] != 0  # the adapters moved the policy off its base
    for model in (kept["models"].policy, kept["models"].critic.seq_cls):
        dtypes = {n: p.dtype for n, p in model.named_parameters()}
        assert {d for n, d in dtypes.items() if ".base_layer." in n} == {torch.bfloat16}
        assert {d for n, d in dtypes.items() if ".base_layer." not in n} == {torch.float32}  # adapters, embeddings,
        assert any("norm" in n for n in dtypes) and any("embed" in n for n in dtypes)  # norms, the heads


TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2)
SHAPES = {"llama": lambda: LlamaConfig(**TINY), "qwen2": lambda: Qwen2Config(**TINY, tie_word_embeddings=True),
          "gpt2": lambda: GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=2)}  # Conv1D: W is (in, out)


@pytest.mark.fast
@pytest.mark.parametrize("base", ["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_saved_lora_policy_is_base_plus_adapter_in_fp32(shape, base, tmp_path):
    """The merged policy that save_models writes has the logits of base + adapter, peft's own merge_and_unload on
    a fresh copy being the reference, and keeps the whole of a small update (|s B A| / |W| = 1e-3) on a
    bf16-stored base held in bf16 (--lora-base-dtype bf16): merged in fp32 and saved in fp32, config.json saying so."""
    from types import SimpleNamespace
    from peft import PeftModel
    from safetensors.torch import load_file
    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[base]
    AutoModelForCausalLM.from_config(SHAPES[shape]()).to(dtype).save_pretrained(tmp_path / "base")
    args = ppo.Args(lora_rank=4)
    policy = ppo.add_lora(ppo.load_model(AutoModelForCausalLM, str(tmp_path / "base"), "--model", args), args, "--model")
    layers = ppo.lora_layers(policy)
    with torch.no_grad():  # a small trained update on every adapted layer
        for layer in layers.values():
            W, A, B = layer.get_base_layer().weight, layer.lora_A["default"].weight, layer.lora_B["default"].weight
            B.normal_()
            delta = layer.scaling["default"] * (B @ A)
            B.mul_(1e-3 * W.norm() / delta.norm())
    if base == "bf16":
        ppo.bf16_bases(policy)  # lossless here: the checkpoint's weights are bf16 numbers
    models = SimpleNamespace(policy=policy, critic=None, stored_dtypes=(ppo.stored_dtype(str(tmp_path / "base"), args),
                             None), policy_path=str(tmp_path / "base"), critic_path=None,
                             shipped_generation_config=policy.generation_config,
                             shipped_tokenizer=SimpleNamespace(save_pretrained=lambda path: None))
    ppo.save_models(str(tmp_path / "out"), models)
    saved = load_file(str(tmp_path / "out" / "policy" / "model.safetensors"))
    assert {v.dtype for v in saved.values()} == {torch.float32}
    assert json.load(open(tmp_path / "out" / "policy" / "config.json"))["dtype"] == "float32"
    fresh = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    for name, layer in layers.items():  # the saved weight minus the base is s B A, at least 99% of it
        delta = layer.scaling["default"] * (layer.lora_B["default"].weight @ layer.lora_A["default"].weight).detach()
        delta = delta.T if layer.fan_in_fan_out else delta
        kept = saved[name + ".weight"] - fresh.get_submodule(name).weight.detach()
        assert (kept - delta).norm() / delta.norm() < 0.01, name
    reference = PeftModel.from_pretrained(fresh, str(tmp_path / "out" / "policy_adapter")).merge_and_unload().eval()
    ids = torch.randint(128, (2, 12))
    with torch.no_grad():
        expected = reference(ids).logits
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "policy").eval()(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert (expected - plain).abs().max() > 1e-4  # the update shows in the logits (merge_and_unload merged `fresh`)


@pytest.mark.fast
@pytest.mark.parametrize("flags, message", [
    (dict(lora_rank=-1), "--lora-rank must be >= 0"),
    (dict(lora_rank=4, lora_alpha=0.0), "--lora-alpha > 0"),
    (dict(lora_rank=4, lora_targets="no_such_proj"), "--lora-targets no_such_proj: "),
    (dict(lora_rank=4, lora_targets="q_proj,lm_head"), "adapts the output head"),
    (dict(lora_rank=4, lora_targets="embed_tokens"), "adapts model.embed_tokens of --model .not a linear layer.: adapters go on linear"),
    (dict(lora_rank=4, lora_targets="q_proj,norm"), "--lora-targets q_proj,norm: .*not supported"),
    (dict(lora_rank=4, ref_model="toy"), "the reference is the policy's base"),
    (dict(lora_rank=4, critic_init="scratch"), "--critic-init scratch with --lora-rank"),
    (dict(lora_rank=4, lora_base_dtype="bf16", precision="fp32"), "--lora-base-dtype bf16 needs"),
    (dict(lora_base_dtype="bf16", precision="bf16"), "--lora-base-dtype bf16 needs --lora-rank"),
])
def test_bad_lora_flags_get_one_line(flags, message):
    with pytest.raises(ppo.UsageError, match=message):
        ppo.main(ppo.Args(run_name="test_lora_bad", total_episodes=64, save_every=0, **flags))
