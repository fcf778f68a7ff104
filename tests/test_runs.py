"""Whole runs of ppo.main in this process, on what a run keeps: a checkpoint stored in bf16 trains with fp32
weights and AdamW states and is saved back in bf16; evaluation draws from its own random stream; an
explicit resume of an earlier step starts a new branch; the newest --keep-checkpoints are kept; a changed
--keep-best starts its best afresh."""
import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import ppo
from test_sharded import checkpoint_contents

pytestmark = pytest.mark.fast
QUICK = dict(batch_size=16, response_length=8, num_ppo_epochs=1, sample_every=0)


def run_main(name, fresh=True, **flags):
    if fresh:
        shutil.rmtree(f"runs/{name}", ignore_errors=True)
    ppo.main(ppo.Args(run_name=name, **dict(QUICK, **flags)))
    return [json.loads(line) for line in open(f"runs/{name}/metrics.jsonl")]


def steps(name):
    return [int(d[5:]) for d in sorted(os.listdir(f"runs/{name}/checkpoints"), key=lambda d: int(d[5:]))]


def without(rows, *prefixes):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "mem/", *prefixes))} for r in rows]


def test_a_checkpoint_stored_in_bf16_trains_in_fp32_and_is_saved_in_bf16(world, tmp_path):
    for cls, src, dst in ((AutoModelForCausalLM, world[0], "policy"), (AutoModelForSequenceClassification, world[1],
                                                                          "reward")):
        cls.from_pretrained(src).to(torch.bfloat16).save_pretrained(tmp_path / dst)  # as most hub checkpoints are
        AutoTokenizer.from_pretrained(src).save_pretrained(tmp_path / dst)
    # one optimizer step at the docs' real-model rate: in bf16 it would move about 1% of the weights
    run_main("test_bf16_stored", model=str(tmp_path / "policy"), reward_model=str(tmp_path / "reward"),
             total_episodes=16, learning_rate=1e-6, critic_learning_rate=1e-6, save_every=1)
    whole = checkpoint_contents("runs/test_bf16_stored/checkpoints/step_1")
    for name in ("policy", "critic"):
        opt = whole[f"{name}_adamw"]
        moments = [t for s in opt["state"].values() for k, t in s.items() if k != "step"]
        assert moments and all(t.dtype == torch.float32 for t in moments), name
        stepped = {k.removeprefix("seq_cls."): v for k, v in whole[name].items()}
        start = load_file(str(tmp_path / ("policy" if name == "policy" else "reward") / "model.safetensors"))
        assert all(t.dtype == torch.float32 for t in stepped.values()), name
        model = (AutoModelForCausalLM.from_pretrained(tmp_path / "policy") if name == "policy" else
                 AutoModelForSequenceClassification.from_pretrained(tmp_path / "reward"))
        moved = total = 0
        for key, _ in model.named_parameters():
            s = opt["state"].get(("seq_cls." if name == "critic" else "") + key)
            if s is None:
                continue
            had_gradient = s["exp_avg"] != 0
            moved += ((stepped[key] != start[key].float()) & had_gradient).sum().item()
            total += had_gradient.sum().item()
        # fp32 keeps steps of 2^-24 of a weight, bf16 only of 2^-9: in bf16 about 1% would move. How many of fp32's
        # steps survive rounding rests on the world each CPU trains (its smallest gradients): 99.8% here; half tells
        assert total > 1000 and moved / total > 0.5, (name, moved, total)
    for name in ("policy", "critic"):  # the final models as the checkpoint came: bf16
        assert json.load(open(f"runs/test_bf16_stored/{name}/config.json"))["dtype"] == "bfloat16"
        assert all(t.dtype == torch.bfloat16 for t in load_file(f"runs/test_bf16_stored/{name}/model.safetensors")
                   .values())


def test_a_tied_head_is_saved_once_in_bf16(tmp_path):
    from transformers import Qwen2Config
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                         num_hidden_layers=1, num_attention_heads=2,
                                                         num_key_value_heads=1, tie_word_embeddings=True))
    ppo.save_in_dtype(model, str(tmp_path), None, torch.bfloat16)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert "lm_head.weight" not in saved and saved["model.embed_tokens.weight"].dtype == torch.bfloat16
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(again.lm_head.weight, model.lm_head.weight.to(torch.bfloat16).float())
    assert next(model.parameters()).dtype == torch.float32  # the model itself trains on in fp32


def test_evaluation_leaves_the_training_stream_alone(world):
    plain = run_main("test_eval_off", total_episodes=48, save_every=0)
    evaluated = run_main("test_eval_on", total_episodes=48, save_every=1, keep_checkpoints=3, eval_every=1, eval_size=8,
                         eval_samples=3, pass_threshold=0.0)
    assert without(evaluated, "eval/") == without(plain)  # training exactly as without evaluation
    assert all("eval/score" in r for r in evaluated)
    for r in evaluated:  # at every evaluation: pass@1 <= pass@2 <= pass@3, and some prompt passes only sometimes
        p = [r[f"eval/pass@{j}"] for j in (1, 2, 3)]
        assert 0 <= p[0] <= p[1] <= p[2] <= 1 and "eval/pass@4" not in r
        for j, x in zip((1, 2, 3), p):  # exact: 8 prompts x C(3, j) x pass@j counts passing j-subsets (float32 is not)
            assert abs(x * 8 * math.comb(3, j) - round(x * 8 * math.comb(3, j))) < 1e-9, (j, x)
    assert any(r["eval/pass@1"] < r["eval/pass@3"] for r in evaluated)
    resumed = run_main("test_eval_resumed", total_episodes=48, save_every=1, eval_every=1, eval_size=8,
                       eval_samples=3, pass_threshold=0.0, resume="runs/test_eval_on/checkpoints/step_1")
    assert without(resumed) == without(evaluated[1:])  # and a resumed run evaluates as the straight one


def test_an_explicit_resume_of_an_earlier_step_drops_the_later_ones(world):
    run_main("test_branches", total_episodes=80, save_every=1, keep_checkpoints=3)
    assert steps("test_branches") == [3, 4, 5]  # the newest --keep-checkpoints
    rows = run_main("test_branches", fresh=False, total_episodes=64, save_every=1, keep_checkpoints=3,
                    resume="runs/test_branches/checkpoints/step_3")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert steps("test_branches") == [3, 4]  # step_5 belonged to the abandoned branch: --resume auto takes step_4
    rows = run_main("test_branches", fresh=False, total_episodes=80, save_every=1, keep_checkpoints=3, resume="auto")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]


def test_an_explicit_resume_of_an_earlier_step_drops_a_later_best(world):
    # `episode` grows every update, so best/ holds update 5; a branch from step 3 that runs no update (the
    # run is cut to 3) must not keep the abandoned branch's best/
    run_main("test_best_branch", total_episodes=80, save_every=1, keep_checkpoints=3, keep_best="episode")
    assert json.load(open("runs/test_best_branch/best/best.json"))["step"] == 5
    run_main("test_best_branch", fresh=False, total_episodes=48, save_every=1, keep_checkpoints=3,
             keep_best="episode", resume="runs/test_best_branch/checkpoints/step_3")
    assert not os.path.exists("runs/test_best_branch/best")


def test_a_changed_keep_best_starts_its_best_afresh(world):
    # update 1 holds the best kl_coef (adaptive KL far below its target shrinks it every update); resumed with
    # another metric, the old best is not comparable: the first update after the resume is the best so far
    flags = dict(total_episodes=48, kl_target=100.0, save_every=1)
    run_main("test_best_metric", keep_best="objective/kl_coef", **flags)
    run_main("test_best_changed", keep_best="objective/non_score_reward", **flags,
             resume="runs/test_best_metric/checkpoints/step_2")
    assert os.path.exists("runs/test_best_changed/best/policy")
