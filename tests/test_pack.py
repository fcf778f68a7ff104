"""Packed passes (issue 65): each forward on the rows' real tokens laid end to end, no padding, gives the padded
path's log-probs, entropies, values and gradients to fp32's rounding (tests/fp32.py), on rows of very different
prompt and response lengths, for each attention implementation transformers builds the packed mask for."""
import math

import pytest
import torch
from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, GPT2Config, LlamaConfig,
                          MistralConfig, Qwen2Config)

import ppo
from fp32 import assert_close_fp32, logprob_tolerance

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
CONFIGS = {"qwen2": lambda: Qwen2Config(**SMALL), "llama": lambda: LlamaConfig(**SMALL),
           "mistral": lambda: MistralConfig(**SMALL, sliding_window=16),
           "gpt2": lambda: GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=256)}


def batch(prompts=(3, 40, 17, 1, 25), responses=(30, 2, 11, 1, 19), seed=0):
    """Rows as ppo.py lays them out: prompts left-padded to the longest, responses (cut at various places) right-padded
    to the longest; token ids where padding sits are junk (they must not matter)."""
    g = torch.Generator().manual_seed(seed)
    P, T = max(prompts), max(responses)
    ids = torch.randint(0, 300, (len(prompts), P + T), generator=g)  # (b, P+T)
    mask = torch.zeros_like(ids)
    for i, (p, t) in enumerate(zip(prompts, responses)):
        mask[i, P - p:P + t] = 1
    return ids, mask, P


def both(model, fn):
    """fn() on the padded path, then on the packed one."""
    model.pack = False
    padded = fn()
    model.pack = True
    return padded, fn()


@pytest.mark.fast
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_packed_passes_give_the_padded_numbers(arch, attention):
    torch.manual_seed(0)
    config = CONFIGS[arch]()
    policy = AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()
    ids, mask, P = batch()
    response = mask[:, P:].bool()  # (b, T): the real response tokens
    n = 128  # the network's longest sum (its MLP's width)
    for chunk in (0, 64):
        (lp, ent, _), (lp2, ent2, _) = both(policy, lambda: ppo.policy_logprobs(policy, ids, mask, P, 0.7, True,
                                                                                 chunk=chunk))
        assert_close_fp32(lp2[response], lp[response], n)
        assert_close_fp32(ent2[response], ent[response], n)
    loss = lambda: (ppo.policy_logprobs(policy, ids, mask, P, 0.7, chunk=64)[0] * response).sum()  # noqa: E731
    grads = []
    for pack in (False, True):
        policy.pack = pack
        policy.zero_grad()
        loss().backward()
        grads.append(torch.cat([p.grad.flatten() for p in policy.parameters()]))
    assert_close_fp32(grads[1], grads[0], n * ids.shape[0] * ids.shape[1])
    config.num_labels = 1
    critic = ppo.ValueModel(AutoModelForSequenceClassification.from_config(config, attn_implementation=attention).eval())
    values, values2 = both(critic, lambda: ppo.state_values(critic, ids, mask, P))  # (b, T+1)
    real = torch.cat([mask[:, P - 1:P], mask[:, P:]], 1).bool()  # (b, T+1): the state before each response token
    assert_close_fp32(values2[real], values[real], n)


@pytest.mark.fast
def test_rows_are_laid_end_to_end_no_longer_than_the_longest():
    ids, mask, P = batch()
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    packed, packed_positions, where = ppo.pack_rows(ids, positions, mask.bool())
    counts = mask.sum(1)
    assert packed.shape[1] == int(counts.max()) and packed.numel() < mask.numel()
    assert packed.numel() >= int(counts.sum()) and len(where.unique()) == int(counts.sum())
    assert torch.equal(packed.flatten()[where], ids[mask.bool()])
    assert torch.equal(packed_positions.flatten()[where], positions[mask.bool()])


@pytest.mark.fast
def test_a_model_that_attends_across_packed_rows_runs_padded(monkeypatch):
    """ppo.py's check finds out a model whose attention crosses the rows of a packed line (here: transformers made
    to see no packed rows in the positions, as an architecture or version that builds no packed mask) and leaves it
    padded; the same model packs where transformers keeps the rows apart."""
    import transformers.masking_utils
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(CONFIGS["qwen2"]()).eval()
    assert ppo.packing_works(policy, torch.device("cpu")) and policy.pack
    monkeypatch.setattr(transformers.masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    assert not ppo.packing_works(policy, torch.device("cpu")) and not policy.pack


@pytest.mark.parametrize("world,flags", [("toy", {}), ("chain", dict(adv_estimator="grpo", group_size=4)),
                                         ("toy", dict(micro_batch_size=8, num_minibatches=2))])
def test_a_packed_run_logs_the_padded_runs_rows(world, flags):
    """Three updates packed and with --no-pack: every row within fp32's rounding (tests/test_sharded.py), the samples
    the same tokens."""
    from test_in_process import run_main
    from test_sharded import assert_same_run
    runs = [run_main(f"test_pack_{world}_{pack}", model=world, total_episodes=192, pack=pack, **flags)
            for pack in (False, True)]
    assert_same_run(runs[1], runs[0])


@pytest.mark.fast
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-sum-norm"])
@pytest.mark.parametrize("policy_loss", ["ppo", "gspo", "cispo"])
def test_a_packed_minibatch_gives_the_padded_losses_and_gradients(world, policy_loss, loss_agg):
    """Phase 7 on a real toy rollout (prompts and responses of several lengths), with the critic, the entropy bonus
    and the KL in the loss, in micro-batches of a token budget (packed: of real tokens, so split otherwise): every
    loss statistic and every gradient within fp32's rounding of the padded path's."""
    from test_ppo_parts import checked, rollout_batch
    policy, critic, rollout, P = rollout_batch(world)
    g = torch.Generator().manual_seed(1)
    rollout.ref_logprobs = rollout.logprobs + 0.05 * torch.randn(rollout.mask.shape, generator=g) * rollout.mask
    rollout.has_eos, rollout.kl_coef = torch.ones(len(rollout.mask), dtype=torch.bool), 0.05
    assert len(set(rollout.attention_mask[:, :P].sum(1).tolist())) > 1 and len(set(rollout.lengths.tolist())) > 1
    args = checked(policy_loss=policy_loss, loss_agg=loss_agg, kl_in_loss=True, ent_coef=0.01,
                   micro_batch_tokens=3 * (P + rollout.mask.shape[1]))
    runs = []
    for pack in (False, True):
        policy.pack = critic.pack = pack
        policy.zero_grad(), critic.zero_grad()
        stats = ppo.minibatch_backward(policy, critic, rollout, torch.arange(len(rollout.mask)), P, args)
        runs.append((stats, [torch.cat([p.grad.flatten() for p in m.parameters()]) for m in (policy, critic)]))
    (padded, padded_grads), (packed, packed_grads) = runs
    n = max(policy.config.hidden_size, policy.config.intermediate_size) * rollout.attention_mask.numel()
    for k in ("pg_loss", "vf_loss", "ratio", "tokens"):
        assert_close_fp32(torch.tensor(packed[k]), torch.tensor(padded[k]), n, k)
    tol = logprob_tolerance(policy, args.temperature)  # the old log-probs' own pass: the ratio is 1 but for rounding
    assert packed["approxkl"] / packed["tokens"] <= tol ** 2 / 2 and packed["ratio_dev_max"] <= math.expm1(tol)
    for a, b in zip(packed_grads, padded_grads):
        assert_close_fp32(a, b, n)
