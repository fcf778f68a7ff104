"""The rollout passes against independent oracles: every log-prob, entropy, value and score that ppo.py
computes on a left-padded, right-padded batch equals what the plain HF model computes on each row
alone, with no padding at all. Position ids, temperature, the value and reward read positions and the
sampler's support each have a way to be silently wrong that these catch (tests/mutants.py lists them)."""
import pytest
import torch
from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, GPT2Config,
                          GenerationConfig)

import ppo
import toy
from fp32 import assert_close_fp32, fp32_tolerance
from test_ppo_parts import checked

pytestmark = pytest.mark.fast
T_HOT = 1.3  # not the default 0.7: a pass that ignores --temperature must show
TOY_SUM = 256  # the toy model's longest sum: its MLP's 256 units (tests/fp32.py: the tolerance grows with it)


def unpadded(qr, am, lengths, P, i):
    """Row i without any padding, and where its response starts in it."""
    p = int(am[i, :P].sum())
    ids = torch.cat([qr[i, P - p:P], qr[i, P:P + int(lengths[i])]])
    return ids, p


def row_logprobs(model, ids, p, n, temperature, top_k=0):
    """Log-probs of the n response tokens of one unpadded row, from the model's own forward."""
    with torch.no_grad():
        logits = model(ids[None]).logits[0, p - 1:p - 1 + n].float() / temperature  # (n, V)
    if top_k:
        kth = logits.topk(top_k, -1).values[:, -1:]  # (n, 1)
        logits = logits.masked_fill(logits < kth, -float("inf"))
    logp = torch.log_softmax(logits, -1)  # (n, V)
    entropy = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)  # (n,)
    return logp.gather(1, ids[p:p + n, None]).squeeze(1), entropy


def sampled_batch(world, temperature=T_HOT, top_k=0, B=16, response_length=8, seed=0):
    """A real batch from the toy policy through ppo.generate: varied prompt and response lengths, some
    responses cut by the length limit."""
    policy_path, _ = world
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(policy_path, padding_side="left")
    policy = ppo.disable_dropout(AutoModelForCausalLM.from_pretrained(policy_path))
    policy.generation_config = GenerationConfig(do_sample=True, temperature=temperature, top_k=top_k, top_p=1.0,
                                                max_new_tokens=response_length, eos_token_id=tok.eos_token_id,
                                                pad_token_id=tok.pad_token_id)
    prompt_ids = [tok(p).input_ids for p in toy.prompts(B, seed=seed)]
    # whether a draw holds both an ended and a cut response depends on the world, which each CPU trains itself:
    # draw again until one does (a draw misses ~30% of the time at most here: 20 misses in a row, < 1e-10)
    for draw in range(1, 21):
        qr, am, lengths, has_eos, mask, P, _ = ppo.generate(policy, tok, prompt_ids, torch.device("cpu"))
        if has_eos.any() and not has_eos.all():
            break
        torch.manual_seed(seed + 1000 * draw)
    assert len(set(am[:, :P].sum(1).tolist())) > 1 and has_eos.any() and not has_eos.all()  # padding both sides
    return policy, qr, am, lengths, mask, P


@pytest.mark.parametrize("chunk", [0, 7])  # the plain head, and the chunked one (7: chunks straddle rows)
def test_rollout_passes_equal_each_row_alone(world, chunk):
    policy, qr, am, lengths, mask, P = sampled_batch(world, response_length=6)
    ref = AutoModelForCausalLM.from_pretrained(world[0])
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))  # a reference that differs from the policy
    seq_cls = AutoModelForSequenceClassification.from_pretrained(world[1]).eval()
    critic = ppo.ValueModel(seq_cls)
    logprobs, ref_logprobs, entropy, values, next_values, support, _ = ppo.rollout_passes(
        policy, ref, critic, qr, am, mask, P, micro=5, temperature=T_HOT, chunk=chunk)
    assert support is None
    for i in range(len(lengths)):
        ids, p = unpadded(qr, am, lengths, P, i)
        n = int(lengths[i])
        want, want_entropy = row_logprobs(policy, ids, p, n, T_HOT)
        assert_close_fp32(logprobs[i, :n], want, TOY_SUM)
        assert_close_fp32(entropy[i, :n], want_entropy, TOY_SUM)
        assert_close_fp32(ref_logprobs[i, :n], row_logprobs(ref, ids, p, n, T_HOT)[0], TOY_SUM)
        with torch.no_grad():  # V before response token j: the classifier read after prompt + response[:j]
            want_values = torch.stack([seq_cls(ids[None, :p + j]).logits[0, 0] for j in range(n + 1)])
        assert_close_fp32(values[i, :n], want_values[:n], TOY_SUM)
        bootstrap = fp32_tolerance(want_values, TOY_SUM)  # its rounding is the row's values', however small it is
        torch.testing.assert_close(next_values[i], want_values[n], atol=bootstrap, rtol=0, msg="the bootstrap value")
        assert (values[i, n:] == 0).all()


def test_reward_model_reads_the_last_real_token(world):
    _, qr, am, lengths, mask, P = sampled_batch(world, seed=1)
    seq_cls = AutoModelForSequenceClassification.from_pretrained(world[1]).eval()
    with torch.no_grad():
        scores = ppo.reward_model_scores(ppo.ValueModel(seq_cls), None, qr, am, lengths, P, None, micro=6)
        want = torch.stack([seq_cls(unpadded(qr, am, lengths, P, i)[0][None]).logits[0, 0]
                            for i in range(len(lengths))])
    torch.testing.assert_close(scores, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk", [0, 7])
def test_the_support_is_kept_at_rollout_when_top_k_binds(world, chunk):
    policy, qr, am, lengths, mask, P = sampled_batch(world, top_k=2, seed=2)
    logprobs, ref_logprobs, _, _, _, support, _ = ppo.rollout_passes(policy, policy, None, qr, am, mask, P, micro=5,
                                                                  temperature=T_HOT, sampler_filter=(2, 1.0),
                                                                  chunk=chunk)
    assert torch.equal(ref_logprobs, logprobs)  # the reference on the same support: KL 0 while it is the policy
    kept = support[0].diff().view(mask.shape)  # (B, T): token ids kept per position
    assert (kept[mask.bool()] == 2).all() and (kept[~mask.bool()] == 0).all()  # two at every sampled position
    for i in range(len(lengths)):
        ids, p = unpadded(qr, am, lengths, P, i)
        n = int(lengths[i])
        truncated, _ = row_logprobs(policy, ids, p, n, T_HOT, top_k=2)
        full, _ = row_logprobs(policy, ids, p, n, T_HOT)
        torch.testing.assert_close(logprobs[i, :n], truncated, atol=1e-5, rtol=0)
        assert (truncated >= full).all()
    assert (logprobs - ppo.rollout_passes(policy, policy, None, qr, am, mask, P, 16, T_HOT)[0]).abs().max() > 1e-2


def test_learned_absolute_positions_see_no_padding():
    # GPT-2 adds a learned embedding per position: position ids that ignore the left padding shift every
    # padded row's positions and change its log-probs (a RoPE model like the toy's would not show it)
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=50, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0, num_labels=1)
    lm = AutoModelForCausalLM.from_config(cfg).eval()
    value_model = ppo.ValueModel(AutoModelForSequenceClassification.from_config(cfg).eval())
    prompts, responses = [[5, 6, 7], [8, 9, 10, 11, 12, 13]], [[20, 21, 22, 23], [24, 25]]
    P, T = 6, 4
    qr = torch.zeros(2, P + T, dtype=torch.long)
    am = torch.zeros(2, P + T, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        qr[i, P - len(p):P], qr[i, P:P + len(r)] = torch.tensor(p), torch.tensor(r)
        am[i, P - len(p):P + len(r)] = 1
    with torch.no_grad():
        logprobs, _, _ = ppo.policy_logprobs(lm, qr, am, P, T_HOT)
        values = ppo.state_values(value_model, qr, am, P)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids = torch.tensor(p + r)
        torch.testing.assert_close(logprobs[i, :len(r)], row_logprobs(lm, ids, len(p), len(r), T_HOT)[0],
                                   atol=1e-5, rtol=0)
        with torch.no_grad():
            want = value_model.seq_cls(ids[None]).logits[0, 0]  # after the last real token
        torch.testing.assert_close(values[i, len(r)], want, atol=1e-5, rtol=0)


def test_value_clip_is_anchored_on_the_rollout_values_in_the_update(world):
    from test_ppo_parts import rollout_batch
    policy, critic, rollout, P = rollout_batch(world, B=16)
    current = rollout.values  # what the critic predicts now (rollout_batch took them from it)
    mask = rollout.mask
    # rollout-time values 1.0 above the current prediction, returns at the prediction: with eps 0.2
    # the clipped value sits 0.8 from the return, so the clip binds on every token and stops its gradient
    vars(rollout).update(values=(current + 1.0) * mask, returns=current)
    stats = ppo.minibatch_backward(policy, critic, rollout, torch.arange(16), P, checked(micro_batch_size=8))
    assert stats["vf_clip"] == stats["tokens"] > 0
    assert all(p.grad is None or p.grad.abs().max() == 0 for p in critic.parameters())


def qwen2_152k():
    """A Qwen2-shaped policy with the real Qwen2 vocabulary, 151,936 tokens (random init, 2 small layers)."""
    from transformers import Qwen2Config
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(Qwen2Config(
        vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=True))


@pytest.mark.parametrize("model_name", ["toy", "qwen2_152k"])
def test_chunked_head_equals_the_plain_path_with_gradients(world, model_name):
    model = AutoModelForCausalLM.from_pretrained(world[0]) if model_name == "toy" else qwen2_152k()
    g = torch.Generator().manual_seed(0)
    B, P, T = 6, 5, 9
    qr = torch.randint(3, model.config.vocab_size, (B, P + T), generator=g)
    am = torch.ones_like(qr)
    am[0, :3], am[1, P + 4:] = 0, 0  # left padding, and a response cut short
    weights = torch.rand(B, T, generator=g)
    out = []
    for chunk in (0, 10):
        model.zero_grad()
        logprobs, entropy, _ = ppo.policy_logprobs(model, qr, am, P, T_HOT, with_entropy=True, chunk=chunk)
        ((logprobs * weights).sum() + entropy.sum()).backward()
        out.append((logprobs, entropy, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (lp0, ent0, g0), (lp1, ent1, g1) = out
    # another matmul shape sums in another order: fp32's rounding of the longest sum, the MLP's in the forward;
    # in the backward the vocabulary's (head) or the MLP's, each gradient tensor relative to its own largest entry
    assert_close_fp32(lp1, lp0, model.config.intermediate_size)
    assert_close_fp32(ent1, ent0, model.config.intermediate_size)
    n = max(model.config.vocab_size, model.config.intermediate_size)
    assert max(g.abs().max() for g in g0.values()) > 1e-3
    for name in g0:
        assert_close_fp32(g1[name], g0[name], n, msg=name)


def test_the_chunked_head_follows_gemma2s_softcap_and_spots_other_transforms(world):
    from transformers import CohereConfig, Gemma2Config
    small = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16)
    gemma2 = AutoModelForCausalLM.from_config(Gemma2Config(**small, final_logit_softcapping=0.5))  # binds hard
    cohere = AutoModelForCausalLM.from_config(CohereConfig(**small, logit_scale=0.3))  # logits x 0.3 after the head
    assert ppo.chunked_head_works(gemma2, torch.device("cpu"))
    assert not ppo.chunked_head_works(cohere, torch.device("cpu"))


def test_the_kept_support_gives_the_same_numbers_chunked_and_plain_at_152k():
    """--keep-sampling-mask at Qwen2's vocabulary: the support top-k 50 then top-p 0.9 keeps at rollout, packed
    as token ids, then the training pass on it, with gradients: the chunked head equals the plain one."""
    model = qwen2_152k()
    B, P, T = 4, 5, 9
    qr = torch.randint(3, model.config.vocab_size, (B, P + T), generator=torch.Generator().manual_seed(1))
    am = torch.ones_like(qr)
    am[0, :3], am[1, P + 4:] = 0, 0  # left padding, and a response cut short
    with torch.no_grad():  # greedy responses: every real token inside the support, as a sampled one would be
        for t in range(T):
            qr[:, P + t] = ppo.forward(model, qr[:, :P + t], am[:, :P + t]).logits[:, -1].argmax(-1)
    weights = torch.rand(B, T, generator=torch.Generator().manual_seed(2))
    out = []
    for chunk in (0, 10):
        with torch.no_grad():
            old, _, keep = ppo.policy_logprobs(model, qr, am, P, T_HOT, sampler_filter=(50, 0.9), chunk=chunk)
        packed = ppo.pack_support(*keep, B * T)
        kept = ppo.kept_pairs(packed, torch.arange(B), T, T)  # packed and back
        model.zero_grad()
        logprobs, entropy, _ = ppo.policy_logprobs(model, qr, am, P, T_HOT, True, kept, chunk=chunk)
        ((logprobs * weights).sum() + entropy.sum()).backward()
        torch.testing.assert_close(logprobs, old, atol=1e-6, rtol=0)  # the same weights: ratio 1 on the support
        support = ppo.dense_support(kept, B * T, model.config.vocab_size)  # (B*T, V)
        rows = torch.tensor([2, 0])  # a minibatch's rows, out of order: their positions' pairs alone
        some = ppo.kept_pairs(packed, rows, T, T)
        want = support.view(B, T, -1)[rows].flatten(0, 1)  # (2*T, V)
        assert torch.equal(ppo.dense_support(some, 2 * T, model.config.vocab_size), want)
        out.append((support, logprobs, entropy, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (s0, lp0, ent0, g0), (s1, lp1, ent1, g1) = out
    assert torch.equal(s0, s1)
    n = s0.sum(-1).view(B, T)[am[:, P:].bool()]  # tokens kept at each real position
    assert n.max() <= 50 and n.min() >= 1 and (n < 50).any()  # top-k binds, and top-p below it somewhere
    assert (s0.sum(-1).view(B, T)[~am[:, P:].bool()] == model.config.vocab_size).all()  # padding: all of it
    full, _, _ = ppo.policy_logprobs(model, qr, am, P, T_HOT)
    assert (lp0 - full)[am[:, P:].bool()].min() > 1e-3  # the truncated distribution, not the softmax
    assert_close_fp32(lp1, lp0, model.config.intermediate_size)  # the forward's longest sum: the MLP's
    assert_close_fp32(ent1, ent0, model.config.intermediate_size)
    n = model.config.vocab_size  # the backward's: over the vocabulary, in the head
    assert max(g.abs().max() for g in g0.values()) > 1e-3
    for name in g0:
        assert_close_fp32(g1[name], g0[name], n, msg=name)


@pytest.mark.parametrize("case", ["softcap", "bias", "bf16"])
def test_the_written_out_head_backward_equals_autograd_through_the_plain_head(case):
    """`HeadLogprobs.backward` has a branch for each: Gemma 2's logit cap, a head with a bias, and the
    forward's autocast, under which the backward must rebuild the logits in bf16 as the forward took them."""
    from transformers import Gemma2Config, LlamaConfig
    small = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16)
    torch.manual_seed(0)
    if case == "softcap":  # a cap of 2 binds: logits of a random head reach several units
        model = AutoModelForCausalLM.from_config(Gemma2Config(**small, final_logit_softcapping=2.0))
    else:
        model = AutoModelForCausalLM.from_config(LlamaConfig(**small))
    if case == "bias":
        model.lm_head.bias = torch.nn.Parameter(torch.randn(small["vocab_size"]))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20)  # confident rows: the entropy's gradient is not flat
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "bf16")
    g = torch.Generator().manual_seed(0)
    B, P, T = 4, 5, 9
    qr = torch.randint(3, small["vocab_size"], (B, P + T), generator=g)
    am = torch.ones_like(qr)
    am[0, :3], am[1, P + 4:] = 0, 0
    weights = torch.rand(B, T, generator=g)
    out = []
    for chunk in (0, 7):
        model.zero_grad()
        with amp:
            logprobs, entropy, _ = ppo.policy_logprobs(model, qr, am, P, T_HOT, with_entropy=True, chunk=chunk)
        ((logprobs * weights).sum() + 0.5 * entropy.sum()).backward()
        out.append((logprobs, entropy, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (lp0, ent0, g0), (lp1, ent1, g1) = out
    for name in g0:
        assert g0[name].abs().max() > 1e-3, name
    if case == "bf16":  # the body's states are the same; the head's matmul shape is not, and may round a logit one
        with torch.no_grad(), amp:  # bf16 ulp apart (on a CPU whose kernel sums another shape in another order)
            s = ppo.forward(model, qr, am).logits.float().abs().max() / T_HOT  # the largest |logit| / T
        u = 2.0 ** (torch.floor(torch.log2(s * T_HOT)) - 7).item() / T_HOT  # one bf16 ulp of it (8 bits), over T
        # each s_j moving by u at most (mean value theorem): log p = s_y - logsumexp(s) by 2u; the entropy, whose
        # slope in s_j is -p_j (s_j - E s), by u * sum_j p_j |s_j - E s| <= 2u (max|s| + u)
        torch.testing.assert_close(lp1, lp0, atol=2 * u, rtol=0)
        torch.testing.assert_close(ent1, ent0, atol=2 * u * (float(s) + u), rtol=0)
        for name in g0:
            torch.testing.assert_close(g1[name], g0[name], atol=2e-2, rtol=2e-2, msg=name)
        return
    assert_close_fp32(lp1, lp0, small["intermediate_size"])  # fp32: the forward's longest sum, the MLP's
    assert_close_fp32(ent1, ent0, small["intermediate_size"])
    n = small["vocab_size"]  # the backward's: over the vocabulary
    for name in g0:
        assert_close_fp32(g1[name], g0[name], n, msg=name)
