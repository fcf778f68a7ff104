"""--precision fp16 (dynamic loss scaling) and --fp32-head: an overflow survived, the head's matmul in fp32 equal to
the plain fp32 computation on the same states, the toy world trained to its gold in fp16, the refusals. A killed fp16
run resuming exactly, its loss scale included: `python tests/kill_points.py --fp16` (tests/test_reliability.py)."""
import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import ppo
from fp32 import assert_close_fp32
from test_in_process import run_main


def forced_overflow(monkeypatch, init_scale=2.0 ** 40):
    """GradScaler starting at `init_scale`: scaled gradients past fp16's 65,504 at once."""
    real = torch.amp.GradScaler
    monkeypatch.setattr(torch.amp, "GradScaler", lambda device: real(device, init_scale=init_scale))


@pytest.mark.fast
def test_fp16_loss_scaling_survives_a_forced_overflow(world, monkeypatch):
    """At a loss scale of 2^40 every backward overflows fp16: each such step is skipped and the scale halved, until
    steps go through; nothing NaN reaches the weights or the metrics, and the run does not stop."""
    forced_overflow(monkeypatch)
    rows = run_main("test_fp16_overflow", precision="fp16", num_minibatches=8, total_episodes=128)
    first, last = rows[0], rows[-1]
    assert first["ppo/skipped_steps"] > 0 and first["ppo/loss_scale"] < 2.0 ** 40
    assert last["ppo/skipped_steps"] < 8 * 4  # steps went through once the scale came down
    assert first["ppo/loss_scale"] == 2.0 ** 40 / 2 ** first["ppo/skipped_steps"]  # halved at each skip
    assert all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
    weights = load_file("runs/test_fp16_overflow/policy/model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())
    before = load_file(os.path.join(world[0], "model.safetensors"))
    assert any(not torch.equal(weights[k], before[k]) for k in weights)  # and it trained


@pytest.mark.fast
@pytest.mark.parametrize("chunk", [0, 256], ids=["plain-head", "chunked-head"])
def test_the_fp32_head_under_bf16_autocast_is_the_fp32_matmul_of_the_same_states(world, chunk):
    """Under bf16 autocast the body's states are bf16-rounded whatever the head does; with --fp32-head the log-probs
    from them equal a float64 head on those same states within fp32 rounding (plain and chunked heads, and the
    chunked head's gradient), where the bf16 head is off by bf16's rounding."""
    model = AutoModelForCausalLM.from_pretrained(world[0]).eval()
    g = torch.Generator().manual_seed(0)
    qr = torch.randint(0, model.config.vocab_size, (4, 20), generator=g)  # (b, P+T)
    am, P, tau = torch.ones_like(qr), 8, 0.7
    amp = torch.autocast("cpu", dtype=torch.bfloat16)
    with torch.no_grad(), amp:
        states = model(input_ids=qr, attention_mask=am, output_hidden_states=True).hidden_states[-1]  # (b, P+T, H)
        bf16_head = ppo.policy_logprobs(model, qr, am, P, tau, chunk=chunk)[0]  # (b, T)
    W = model.get_output_embeddings().weight.double()  # (V, H)
    logits = (states[:, P - 1:-1].double() @ W.T) / tau  # (b, T, V)
    exact = torch.log_softmax(logits, -1).gather(2, qr[:, P:, None]).squeeze(2)  # (b, T), float64
    ppo.fp32_head(model.get_output_embeddings())
    with amp:
        fp32_head = ppo.policy_logprobs(model, qr, am, P, tau, chunk=chunk)[0]  # (b, T)
    assert_close_fp32(fp32_head.double(), exact, model.config.hidden_size)
    assert (bf16_head.double() - exact).abs().max() > 100 * (fp32_head.double() - exact).abs().max()
    if chunk:  # the gradient through the chunked head's own backward, outside autocast too
        hidden = states[:, P - 1:-1].detach().flatten(0, 1).float().requires_grad_()  # (b*T, H)
        head = model.get_output_embeddings()
        with amp, torch.autocast("cpu", enabled=False):
            lp, _ = ppo.HeadLogprobs.apply(hidden, head.weight, head.bias, qr[:, P:].flatten(), tau, False, None,
                                           None, None)
        lp.sum().backward()
        h64 = hidden.detach().double().requires_grad_()
        torch.log_softmax(h64 @ W.T / tau, -1).gather(1, qr[:, P:].flatten()[:, None]).sum().backward()
        assert_close_fp32(hidden.grad.double(), h64.grad, model.config.vocab_size)


def test_fp16_trains_the_toy_world_to_its_gold(world):
    """The whole default toy run in fp16: the same target the fp32 run reaches (tests/test_e2e.py), from the same
    start (docs/precision.md: three seeds of each)."""
    rows = run_main("test_fp16_toy", precision="fp16", total_episodes=6400, batch_size=64)
    gold = [r["objective/gold"] for r in rows]
    assert gold[0] <= 0.5 and sum(gold[-10:]) / 10 >= 0.8, gold
    assert all(r["ppo/policy/ratio_at_start"] < 1e-2 for r in rows)  # the health check's default tolerance


@pytest.mark.fast
def test_fp16_where_it_is_not_written_is_refused_in_one_line():
    with pytest.raises(ppo.UsageError, match="--precision fp16 under torchrun"):
        ppo.check_args(ppo.Args(precision="fp16"), 2)
    with pytest.raises(ppo.UsageError, match="--lora-base-dtype bf16 needs"):
        ppo.check_args(ppo.Args(precision="fp16", lora_rank=8, lora_base_dtype="bf16"), 1)
