"""Multi-turn episodes (--env): the action mask, the rewards on each turn's last agent token, GAE over the
agent's tokens across observations against an independent loop, the sampled ids kept as they are, the
observations out of every loss, chat templates' deltas on real tokenizers, and each kind of broken env."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

import envs
import ppo
import real_models
from fp32 import assert_close_fp32, logprob_tolerance, ratio_tolerance
from gae import compute_gae, compute_gae_over_actions

ENVS = "envs"  # tests/envs.py, imported as a module: the same one the tests read the log of


def gae_per_episode(rewards, values, mask, gamma, lam, bootstrap=None, cut=False, ends=None):
    """The recursion over each row's agent tokens alone (float64): V after a turn's last token is V at
    the next turn's first agent token; after the episode's last, 0 or the bootstrap value. `cut`: the
    trace restarts at each observation (--no-gae-across-observations); `ends` (B, T): after each 1 in it."""
    adv = np.zeros_like(rewards)
    for b in range(len(rewards)):
        agent = np.flatnonzero(mask[b])  # the agent's positions, observations skipped
        last, lam_b = 0.0, lam[b] if np.ndim(lam) else lam
        for j in reversed(range(len(agent))):
            t = agent[j]
            after = values[b, agent[j + 1]] if j + 1 < len(agent) else (0.0 if bootstrap is None else bootstrap[b])
            if cut and j + 1 < len(agent) and agent[j + 1] > t + 1 or ends is not None and ends[b, t]:
                last = 0.0  # an observation lies between t and the next agent token, or a turn ends at t
            last = rewards[b, t] + gamma * after - values[b, t] + gamma * lam_b * last
            adv[b, t] = last
    return adv, (adv + values) * mask


@pytest.mark.fast
def test_compacted_gae_equals_a_per_episode_loop():
    g = torch.Generator().manual_seed(0)
    B, T = 6, 20
    mask = (torch.rand(B, T, generator=g) < 0.6).float()  # holes anywhere: observations between turns
    mask[:, 0], mask[0] = 1.0, 0.0  # an empty row too
    mask[0, :3] = 1.0
    rewards, values = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    boot, lam = torch.randn(B, generator=g), torch.rand(B, generator=g)
    for gamma, lams, bootstrap in ((1.0, 0.95, None), (0.9, 0.8, boot), (0.99, lam, boot)):
        adv, ret = compute_gae_over_actions(rewards * mask, values * mask, mask, gamma, lams, bootstrap)
        want_adv, want_ret = gae_per_episode((rewards * mask).double().numpy(), (values * mask).double().numpy(),
                                             mask.numpy(), gamma, lams.numpy() if torch.is_tensor(lams) else lams,
                                             None if bootstrap is None else bootstrap.double().numpy())
        torch.testing.assert_close(adv.double(), torch.from_numpy(want_adv), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ret.double(), torch.from_numpy(want_ret), atol=1e-5, rtol=1e-5)
    prefix = (torch.arange(T) < torch.randint(1, T + 1, (B, 1), generator=g)).float()  # one turn: the scan itself
    for a, b in zip(compute_gae_over_actions(rewards, values, prefix, 0.9, 0.8, boot),
                    compute_gae(rewards, values, prefix, 0.9, 0.8, boot)):
        assert torch.equal(a, b)


@pytest.fixture(scope="module")
def episodes():
    """Two in-process updates of the toy world with three-turn episodes (tests/envs.py:Replies): the
    rollouts phase 7 trained on, the ids `generate` sampled on each turn, the env's log and the metrics."""
    seen, sampled = [], []
    real_backward, real_generate = ppo.minibatch_backward, ppo.generate

    def generate(*a, **k):
        out = real_generate(*a, **k)
        qr, lengths, P = out[0], out[2], out[5]
        sampled.append([qr[i, P:P + int(n)].tolist() for i, n in enumerate(lengths)])
        return out
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ppo, "minibatch_backward", lambda policy, critic, rollout, *a, **k: (
            seen.append((rollout, policy, critic, a, k)), real_backward(policy, critic, rollout, *a, **k))[1])
        m.setattr(ppo, "generate", generate)
        envs.LOG.clear()
        shutil.rmtree("runs/test_multiturn", ignore_errors=True)
        args = ppo.Args(run_name="test_multiturn", env=f"{ENVS}:Replies", max_turns=4, total_episodes=32,
                        batch_size=16, num_ppo_epochs=1, sample_every=1, save_every=0, whiten_advantages=False,
                        kl_coef=0.2)
        ppo.main(args)
    rollouts = [s for s in seen]
    rows = [json.loads(line) for line in open("runs/test_multiturn/metrics.jsonl")]
    return rollouts, sampled, list(envs.LOG), rows, args


def segments(mask_row):
    """(start, end) of each run of 1s: the agent's turns."""
    m = np.concatenate([[0], mask_row, [0]])
    d = np.diff(m)
    return list(zip(np.flatnonzero(d == 1), np.flatnonzero(d == -1)))


@pytest.mark.fast
def test_the_episode_is_the_sampled_ids_and_the_observations_tokens(episodes):
    rollouts, sampled, log, _, args = episodes
    tok = AutoTokenizer.from_pretrained("runs/toy/policy")
    rollout = rollouts[0][0]  # update 1: its three turns are the first three calls of generate
    P = rollout.query_responses.shape[1] - rollout.mask.shape[1]
    seeds = ppo.row_keys(args, 1, 0, 0, 16, args.group_size)
    steps = {(s, turn): (text, obs, r) for s, turn, text, obs, r in log[:48]}
    assert len(steps) == 48
    for b in range(16):
        ids = rollout.query_responses[b, P:P + int(rollout.lengths[b])].tolist()
        mask = rollout.mask[b, :len(ids)].numpy()
        turns = segments(mask)
        assert len(turns) == 3 and mask[-1] == 1  # three turns; the episode ends on an agent token
        for k, (start, end) in enumerate(turns):
            assert ids[start:end] == sampled[k][b]  # the sampled ids themselves, never decoded and re-encoded
            text, observation, _ = steps[(seeds[b], k + 1)]
            assert text == tok.decode(ids[start:end], skip_special_tokens=True)  # what the env was shown
            if k < 2:  # the observation's own tokens fill the hole up to the next turn, with mask 0
                nxt = turns[k + 1][0]
                assert ids[end:nxt] == tok(observation, add_special_tokens=False).input_ids
        assert rollout.attention_mask[b, P:].sum() == len(ids)


@pytest.mark.fast
def test_the_sampled_ids_stay_on_a_byte_level_bpe(tmp_path, monkeypatch):
    """Random GPT-2 tokens rarely survive decoding and re-encoding (TRL #5224): the episode keeps the ids."""
    from transformers import AutoModelForCausalLM, GPT2Config
    tok = AutoTokenizer.from_pretrained(real_models.tokenizer_dir("gpt2"))
    config = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=128, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    seen, sampled, real_generate = [], [], ppo.generate

    def generate(*a, **k):
        out = real_generate(*a, **k)
        sampled.append([out[0][i, out[5]:out[5] + int(n)].tolist() for i, n in enumerate(out[2])])
        return out
    monkeypatch.setattr(ppo, "generate", generate)
    real_backward = ppo.minibatch_backward
    monkeypatch.setattr(ppo, "minibatch_backward", lambda policy, critic, rollout, *a, **k: (
        seen.append(rollout), real_backward(policy, critic, rollout, *a, **k))[1])
    shutil.rmtree("runs/test_bpe", ignore_errors=True)
    ppo.main(ppo.Args(model=str(tmp_path), env=f"{ENVS}:Replies", max_turns=2, response_length=8, total_episodes=16,
                      batch_size=16, num_ppo_epochs=1, save_every=0, run_name="test_bpe"))
    rollout = seen[0]
    P = rollout.query_responses.shape[1] - rollout.mask.shape[1]
    changed = 0
    for b in range(16):
        ids = rollout.query_responses[b, P:P + int(rollout.lengths[b])].tolist()
        turns = segments(rollout.mask[b, :len(ids)].numpy())
        assert [ids[s:e] for s, e in turns] == [sampled[0][b], sampled[1][b]]
        changed += sum(tok(tok.decode(t[b]), add_special_tokens=False).input_ids != t[b] for t in sampled)
    assert changed >= 2  # the case is real: re-encoding would have changed these turns


@pytest.mark.fast
def test_rewards_sit_on_each_turns_last_agent_token(episodes):
    rollouts, _, log, rows, args = episodes
    rollout = rollouts[0][0]
    seeds = ppo.row_keys(args, 1, 0, 0, 16, args.group_size)
    steps = {(s, turn): r for s, turn, _, _, r in log[:48]}
    expected = torch.zeros_like(rollout.rewards)
    for b in range(16):
        for k, (start, end) in enumerate(segments(rollout.mask[b].numpy())):
            expected[b, end - 1] = steps[(seeds[b], k + 1)]
    torch.testing.assert_close(rollout.rewards - rollout.non_score_reward, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(rollout.scores, expected.sum(1))  # the return: the steps' sum
    assert rows[0]["env/turns"] == 3 and rows[0]["ppo/val/eos_rate"] == 1.0


@pytest.mark.fast
def test_gae_runs_over_the_agents_tokens_across_observations(episodes):
    rollouts, _, _, _, args = episodes
    for rollout, *_ in rollouts:
        mask = rollout.mask.double().numpy()
        adv, ret = gae_per_episode(rollout.rewards.double().numpy(), rollout.values.double().numpy(), mask,
                                   args.gamma, args.lam)
        torch.testing.assert_close(rollout.advantages.double(), torch.from_numpy(adv), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(rollout.returns.double(), torch.from_numpy(ret), atol=1e-5, rtol=1e-5)


def ablation_rollout(monkeypatch, env, run_name):
    """The rollout phase 7 trains on in update 1 of a --no-gae-across-observations run on tests/envs.py's `env`,
    and the run's Args."""
    seen, real_backward = [], ppo.minibatch_backward
    monkeypatch.setattr(ppo, "minibatch_backward", lambda policy, critic, rollout, *a, **k: (
        seen.append(rollout), real_backward(policy, critic, rollout, *a, **k))[1])
    shutil.rmtree(f"runs/{run_name}", ignore_errors=True)
    args = ppo.Args(run_name=run_name, env=f"{ENVS}:{env}", max_turns=4, total_episodes=16, batch_size=16,
                    num_ppo_epochs=1, save_every=0, whiten_advantages=False, gae_across_observations=False)
    ppo.main(args)
    return seen[0], args


@pytest.mark.fast
def test_the_ablation_restarts_the_trace_at_each_observation(monkeypatch):
    rollout, args = ablation_rollout(monkeypatch, "Replies", "test_gae_cut")
    rewards, values, mask = (x.double().numpy() for x in (rollout.rewards, rollout.values, rollout.mask))
    adv, ret = gae_per_episode(rewards, values, mask, args.gamma, args.lam, cut=True)
    torch.testing.assert_close(rollout.advantages.double(), torch.from_numpy(adv), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rollout.returns.double(), torch.from_numpy(ret), atol=1e-5, rtol=1e-5)
    across, _ = gae_per_episode(rewards, values, mask, args.gamma, args.lam)
    assert np.abs(across - adv).max() > 1e-3  # (the two differ on these episodes)


@pytest.mark.fast
def test_turns_are_the_envs_steps_even_where_an_observation_is_no_tokens(monkeypatch):
    """Silent's observations are "": nothing of the mask marks where a turn ends. The turns are counted from the
    env's steps, and the ablation still restarts the trace after each turn: the ends are where `generate` stopped."""
    turn_lengths, real_generate = [], ppo.generate

    def generate(*a, **k):
        out = real_generate(*a, **k)
        turn_lengths.append(out[2].tolist())
        return out
    monkeypatch.setattr(ppo, "generate", generate)
    rollout, args = ablation_rollout(monkeypatch, "Silent", "test_silent")
    row = json.loads(open("runs/test_silent/metrics.jsonl").readline())
    assert row["env/turns"] == 3 and row["env/turns_when_ended"] == 3  # (1.0 counted from the mask)
    assert rollout.mask.sum().item() == rollout.lengths.sum().item()  # no observation token anywhere
    ends = np.zeros(rollout.mask.shape)
    ends[np.arange(16)[:, None], np.cumsum(np.array(turn_lengths[:3]).T, 1) - 1] = 1.0  # each turn's last token
    rewards, values, mask = (x.double().numpy() for x in (rollout.rewards, rollout.values, rollout.mask))
    adv, ret = gae_per_episode(rewards, values, mask, args.gamma, args.lam, ends=ends)
    torch.testing.assert_close(rollout.advantages.double(), torch.from_numpy(adv), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rollout.returns.double(), torch.from_numpy(ret), atol=1e-5, rtol=1e-5)
    across, _ = gae_per_episode(rewards, values, mask, args.gamma, args.lam)
    assert np.abs(across - adv).max() > 1e-3  # (restarting changes these episodes' advantages)


@pytest.mark.fast
def test_the_kl_is_on_the_agents_tokens_only_and_the_passes_agree(episodes):
    rollouts, _, _, rows, _ = episodes
    rollout = rollouts[-1][0]  # update 2: the policy has moved from the reference
    P = rollout.query_responses.shape[1] - rollout.mask.shape[1]
    observations = (rollout.attention_mask[:, P:] == 1) & (rollout.mask == 0)  # (B, T)
    assert observations.any() and (rollout.kl[observations] == 0).all()
    assert (rollout.kl[rollout.mask == 1] != 0).any()
    tol = ratio_tolerance("runs/toy/policy")
    assert all(r["ppo/policy/ratio_at_start"] < tol for r in rows)  # fp32: rollout and training passes agree


@pytest.mark.fast
def test_observation_tokens_carry_no_gradient(episodes):
    rollouts, _, _, _, args = episodes
    rollout, policy, critic, a, k = rollouts[-1]
    P = rollout.query_responses.shape[1] - rollout.mask.shape[1]
    observations = (rollout.attention_mask[:, P:] == 1) & (rollout.mask == 0)  # (B, T)
    assert observations.sum() > 10
    flags = ppo.Args(**{**vars(args), "kl_in_loss": True, "kl_estimator": "k3", "ent_coef": 0.01})

    def grads(r):
        stats = ppo.minibatch_backward(policy, critic, r, torch.arange(16), P, flags)
        out = [p.grad.clone() for m in (policy, critic) for p in m.parameters()]
        for m in (policy, critic):
            m.zero_grad(set_to_none=True)
        return stats, out
    base = grads(rollout)
    noisy = ppo.Rollout(**vars(rollout))
    g = torch.Generator().manual_seed(0)
    for name in ("logprobs", "ref_logprobs", "values", "returns", "advantages"):
        x = getattr(rollout, name).clone()
        x[observations] += torch.randn(int(observations.sum()), generator=g) * 3
        setattr(noisy, name, x)
    stats, out = grads(noisy)
    assert stats == base[0]
    assert all(torch.equal(x, y) for x, y in zip(out, base[1]))


@pytest.mark.fast
def test_a_one_turn_env_gives_the_rows_of_its_reward_function():
    common = dict(total_episodes=48, batch_size=16, num_ppo_epochs=2, sample_every=0, save_every=0,
                  missing_eos_penalty=None)  # (an env that says done ends its episode: it is not cut)
    rows = {}
    for name, flags in (("test_one_turn_fn", dict(reward_fn=f"{ENVS}:great_reward",
                                                    dataset=None)),
                        ("test_one_turn_env", dict(env=f"{ENVS}:OneTurn"))):
        shutil.rmtree(f"runs/{name}", ignore_errors=True)
        ppo.main(ppo.Args(run_name=name, **common, **flags))
        rows[name] = [json.loads(line) for line in open(f"runs/{name}/metrics.jsonl")]
    skip = ("time/", "mem/", "objective/reward_fn", "objective/env", "env/", "ppo/val/eos_rate", "objective/gold")
    for a, b in zip(rows["test_one_turn_fn"], rows["test_one_turn_env"]):
        assert a["objective/reward_fn"] == b["objective/env"]
        assert {k: v for k, v in a.items() if not k.startswith(skip)} == \
            {k: v for k, v in b.items() if not k.startswith(skip)}
    assert len(rows["test_one_turn_env"]) == 3


@pytest.mark.fast
@pytest.mark.parametrize("bad, message", [
    ("reset raises", "reset\\(\\) raised ValueError on turn 0: no such level"),
    ("step raises", "step\\(\\) raised ZeroDivisionError on turn 1"),
    ("a list", "step\\(\\) on turn 1 returned .*return a tuple"),
    ("two values", "return a tuple \\(observation, reward, done\\)"),
    ("nan reward", "the reward nan: return a finite number"),
    ("text reward", "the reward '1': return a finite number"),
    ("done is 1", "done = 1: return True or False"),
    ("None while not done", "the observation None: return a string"),
    ("a huge observation", "is 400 tokens, no room left in --max-episode-tokens 200"),
    ("the constructor raises", "Bad\\(\\) raised RuntimeError on turn 0: no levels installed"),
])
def test_a_broken_env_gets_one_line(bad, message, monkeypatch):
    monkeypatch.setattr(envs.Bad, "BAD", bad)
    with pytest.raises(ppo.UsageError, match=f"--env {ENVS}:Bad: .*{message}"):
        ppo.main(ppo.Args(run_name="test_bad_env", env=f"{ENVS}:Bad", max_turns=3, total_episodes=16, batch_size=16,
                          num_ppo_epochs=1, save_every=0))


@pytest.mark.fast
@pytest.mark.parametrize("flags, message", [
    (dict(env=f"{ENVS}:NoRows"), "has no rows: pass --dataset, or give the class a static rows"),
    (dict(env=f"{ENVS}:great_reward"), "must be a class with reset.*: it is a function"),
    (dict(env=f"{ENVS}:NoRowsAtAll"), "rows\\(n, seed\\) must return a non-empty list of dicts"),
    (dict(env=f"{ENVS}:Missing"), "--env .* cannot be loaded \\(AttributeError"),
    (dict(max_turns=3), "--max-turns 3 needs --env"),
    (dict(env=f"{ENVS}:Replies", reward_fn=f"{ENVS}:great_reward"), "--env gives the rewards"),
    (dict(max_episode_tokens=30), "--max-episode-tokens needs --env"),
])
def test_env_flags_that_cannot_work_are_refused(flags, message):
    with pytest.raises(ppo.UsageError, match=message):
        ppo.main(ppo.Args(run_name="test_bad_env", total_episodes=16, batch_size=16, save_every=0, **flags))


CHAT = [{"role": "user", "content": "guess 1 16 ?"}]
TOOLS = ("{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
         "</tool_response>{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # ChatML with a tool role (Qwen2.5's)


@pytest.mark.fast
@pytest.mark.parametrize("name, stop, expected", [
    ("qwen2", "<|im_end|>", "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"),
    ("qwen2", None, "<|im_end|>\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"),  # cut by the limit
    ("qwen2-tools", "<|im_end|>", "\n<|im_start|>user\n<tool_response>\nhigher\n</tool_response><|im_end|>\n"
                                  "<|im_start|>assistant\n"),
    ("llama", "</s>", "\n<|user|>\nhigher</s>\n<|assistant|>\n"),
    ("mistral", "</s>", "[INST] higher [/INST]"),
    ("mistral", None, "</s>[INST] higher [/INST]"),
])
def test_a_chat_models_observation_is_its_templates_delta(name, stop, expected):
    tok = AutoTokenizer.from_pretrained(real_models.tokenizer_dir(name.split("-")[0]))
    if name == "qwen2-tools":
        tok.chat_template = TOOLS
    chat = [dict(m) for m in CHAT]
    ids = ppo.observation_ids(tok, chat, "8", "higher", stop and tok.convert_tokens_to_ids(stop),
                              ppo.Args(env="x.py:E"), 1)
    assert tok.decode(ids) == expected
    assert chat[1:] == [{"role": "assistant", "content": "8"},
                        {"role": "tool" if name == "qwen2-tools" else "user", "content": "higher"}]


@pytest.mark.fast
@pytest.mark.parametrize("rewrite", ["...", "{{ m.content.split('</think>')[-1] }}"])
def test_a_template_that_rewrites_earlier_turns_is_refused(rewrite):
    tok = AutoTokenizer.from_pretrained(real_models.tokenizer_dir("qwen2"))
    # an assistant turn rendered otherwise once a message follows it: replaced, or stripped of its reasoning
    # (Qwen3's template does that; it shows only with reasoning in the turn's own text)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and not "
                         "loop.last %}" + rewrite + "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(ppo.UsageError, match="the chat template rewrites earlier turns"):
        ppo.observation_ids(tok, [dict(m) for m in CHAT], "<think>halve it</think>8", "higher", None,
                            ppo.Args(env="x.py:E"), 1)


def test_two_ranks_train_on_episodes_as_one_process(tmp_path, monkeypatch):
    """One update on a saved batch of three-turn episodes (tests/fsdp_update.py): 2 ranks equal 1 within 1e-6."""
    from test_fsdp import torchrun
    seen = []
    monkeypatch.setattr(ppo, "minibatch_backward", lambda policy, critic, rollout, *a, **k: seen.append(rollout) or {
        "ratio_dev_max": 0.0, "ratio_dev": 0.0, "tokens": 1.0, "pg_clip": 0.0, "approxkl": 0.0})
    shutil.rmtree("runs/test_fsdp_episodes", ignore_errors=True)
    with pytest.raises(Exception):  # (the stub stops the run once it has the rollout)
        ppo.main(ppo.Args(env=f"{ENVS}:Replies", max_turns=3, total_episodes=32, batch_size=32, num_ppo_epochs=1,
                          save_every=0, run_name="test_fsdp_episodes"))
    rollout = seen[0]
    keep = ("query_responses", "attention_mask", "lengths", "mask", "has_eos", "logprobs", "ref_logprobs", "values",
            "advantages", "returns")
    P = rollout.query_responses.shape[1] - rollout.mask.shape[1]
    torch.save({**{k: getattr(rollout, k) for k in keep}, "kl_coef": 0.05, "P": P}, tmp_path / "episodes.pt")
    assert ((rollout.attention_mask[:, P:] == 1) & (rollout.mask == 0)).any()  # observations between turns
    results = {}
    for n in (1, 2):
        out = torchrun(n, "tests/fsdp_update.py", str(tmp_path / f"w{n}.pt"), str(tmp_path / "episodes.pt"))
        assert out.returncode == 0, out.stderr[-3000:]
        results[n] = torch.load(tmp_path / f"w{n}.pt", weights_only=True)
    one, two = results[1]["grads"], results[2]["grads"]
    assert max(g.abs().max().item() for g in one.values()) > 1e-3
    for k in one:  # a weight's gradient sums over every position of the batch; two ranks group the sum otherwise
        assert_close_fp32(two[k], one[k], int(rollout.attention_mask.sum()), msg=k)
    for model in ("policy", "critic"):
        for k in results[1][model]:
            torch.testing.assert_close(results[2][model][k], results[1][model][k], atol=1e-5, rtol=0)


def test_the_engine_scores_episodes_as_the_trainer_does():
    """--vllm with three-turn episodes: the engine's log-probs of the agent's tokens, sampled with the
    observations in their context, within 1e-5 of the trainer's (mean over agent tokens), before and after a push."""
    pytest.importorskip("vllm")
    shutil.rmtree("runs/test_vllm_episodes", ignore_errors=True)
    out = subprocess.run([sys.executable, "ppo.py", "--vllm", "--env", "tests/envs.py:Replies", "--max-turns", "3",
                          "--total-episodes", "64", "--batch-size", "32", "--run-name", "test_vllm_episodes",
                          "--save-every", "0"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in open("runs/test_vllm_episodes/metrics.jsonl")]
    assert len(rows) == 2 and all(r["env/turns"] == 3 for r in rows)
    tol = logprob_tolerance("runs/toy/policy")  # the engine's kernels and the trainer's: two orders of fp32 sums
    assert all(r["rollout/logprob_diff_mean"] < tol for r in rows), [r["rollout/logprob_diff_mean"] for r in rows]


@pytest.mark.fast
def test_the_docs_example_env_runs(tmp_path):
    text = open("docs/agents.md").read()
    code = "\n".join(line[4:] for line in text.split("    class Maze:", 1)[1].split("\n- **The contract")[0]
                     .splitlines())
    (tmp_path / "maze.py").write_text("class Maze:" + code)
    shutil.rmtree("runs/test_maze", ignore_errors=True)
    ppo.main(ppo.Args(env=f"{tmp_path}/maze.py:Maze", max_turns=8, total_episodes=16, batch_size=16,
                      num_ppo_epochs=1, save_every=0, run_name="test_maze", response_length=4))
    row = json.loads(open("runs/test_maze/metrics.jsonl").readline())
    assert 1 < row["env/turns"] <= 8 and row["ppo/policy/ratio_at_start"] < ratio_tolerance("runs/toy/policy")


def test_episodes_are_exact_through_a_kill_and_resume():
    """The env's seeds come from (seed, update, rank): a run killed after update 1 and resumed plays the
    episodes the straight run played, and logs its rows bit for bit."""
    from test_resume import straight_and_resumed
    flags = ["--env", "tests/envs.py:Replies", "--max-turns", "3", "--total-episodes", "48", "--batch-size", "16",
             "--save-every", "1", "--sample-every", "1"]
    runs = straight_and_resumed("test_env", flags)
    for name in ("metrics.jsonl", "samples.jsonl"):
        rows = [[{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "mem/"))}
                 for line in open(f"runs/{run}/{name}")] for run in runs]
        assert len(rows[0]) == {"metrics.jsonl": 3, "samples.jsonl": 12}[name] and rows[0] == rows[1], name


@pytest.mark.parametrize("flags", [
    dict(adv_estimator="grpo", group_size=4), dict(adv_estimator="rloo", group_size=4, loss_agg="seq-sum-norm"),
    dict(bootstrap_truncated=True, missing_eos_penalty=None, max_turns=2),  # (Replies is done after 3 turns)
    dict(overlong_filter=True, overlong_buffer=60, max_turns=2), dict(lam_alpha=0.05, critic_lam=1.0),
    dict(loss_agg="seq-mean-token-mean", kl_in_loss=True, whiten_rewards=True, dual_clip=3.0),
    dict(top_k=10, keep_sampling_mask=True), dict(micro_batch_tokens=200, num_minibatches=2),
    dict(eval_every=1, keep_best="eval/score", critic_warmup_updates=1, ent_coef=0.01),
    dict(kl_target=1.0, target_kl=0.01, eval_greedy=True, eval_every=2),
], ids=lambda f: "+".join(f))
def test_every_variant_runs_with_episodes(flags):
    shutil.rmtree("runs/test_env_variants", ignore_errors=True)
    ppo.main(ppo.Args(env=f"{ENVS}:Replies", total_episodes=32, batch_size=16, num_ppo_epochs=2, save_every=0,
                      run_name="test_env_variants", **{"max_turns": 3, **flags}))
    rows = [json.loads(line) for line in open("runs/test_env_variants/metrics.jsonl")]
    tol = ratio_tolerance("runs/toy/policy")
    assert len(rows) == 2 and all(r["ppo/policy/ratio_at_start"] < tol for r in rows)


@pytest.mark.mutants  # (the mutation check runs it: one mutant only two ranks show)
def test_torchrun_plays_episodes_of_different_lengths_on_each_rank(tmp_path):
    """Two FSDP ranks generate with HF in lockstep (every forward needs both): one rank's episodes may all
    end while the other's go on, and it must keep joining the turns until the last episode anywhere ends.
    The turns per ended episode are over all ranks' ended episodes, whose counts differ from rank to rank."""
    from test_fsdp import torchrun
    shutil.rmtree("runs/test_env_ranks", ignore_errors=True)
    out = torchrun(2, "ppo.py", "--env", "tests/envs.py:Uneven", "--max-turns", "3", "--total-episodes", "32",
                   "--batch-size", "16", "--run-name", "test_env_ranks", "--save-every", "0")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in open("runs/test_env_ranks/metrics.jsonl")]
    args, counts = ppo.Args(env="tests/envs.py:Uneven"), []
    for update, row in enumerate(rows, 1):
        turns = [[1 + s % 4 for s in ppo.row_keys(args, update, 0, rank, 8, args.group_size)]  # (Uneven's)
                 for rank in (0, 1)]
        ended = [[t for t in ts if t <= 3] for ts in turns]  # four turns: cut at --max-turns 3
        counts.append((len(ended[0]), len(ended[1])))
        assert row["env/turns"] == pytest.approx(np.mean(np.minimum(turns, 3)), abs=1e-6)
        assert row["env/turns_when_ended"] == pytest.approx(np.mean(ended[0] + ended[1]), abs=1e-6)
    tol = ratio_tolerance("runs/toy/policy")
    assert len(rows) == 2 and all(r["ppo/policy/ratio_at_start"] < tol for r in rows)
    assert any(a != b for a, b in counts)  # (where the ranks' counts are equal, the mean of their means is right too)


@pytest.mark.fast
def test_episodes_are_cut_where_the_cap_or_the_context_leaves_no_room(monkeypatch):
    """An observation that does not fit ends its episode, cut (not an error): at --max-episode-tokens, and
    where a whole next turn would overflow the model's positions (the toy's 128)."""
    seen, real = [], ppo.minibatch_backward
    monkeypatch.setattr(ppo, "minibatch_backward", lambda policy, critic, rollout, *a, **k: (
        seen.append(rollout), real(policy, critic, rollout, *a, **k))[1])
    for env, turns, cap in (("Replies", 3, 20), ("Long", 8, None)):  # None: the default, 576, past the context
        shutil.rmtree("runs/test_env_cut", ignore_errors=True)
        ppo.main(ppo.Args(env=f"{ENVS}:{env}", max_turns=turns, max_episode_tokens=cap, total_episodes=16,
                          batch_size=16, num_ppo_epochs=1, save_every=0, run_name="test_env_cut"))
        rollout = seen[-1]
        ends = rollout.mask.gather(1, (rollout.lengths - 1)[:, None]).squeeze(1)
        assert (~rollout.has_eos).all() and (ends == 1).all()  # all cut; every episode ends on an agent token
        if cap:
            assert (rollout.lengths <= cap).all() and (rollout.lengths > cap - 10).any()
        else:
            assert (rollout.attention_mask.sum(1) <= 128).all() and (rollout.attention_mask.sum(1) > 128 - 24 - 40).all()


@pytest.mark.fast
def test_evaluation_episodes_get_seeds_of_their_own_the_same_at_every_update(monkeypatch):
    """An evaluation prompt's episode seed depends on the prompt alone: the evaluations of two updates play the
    same games, on any number of ranks (each rank takes prompts j by their index); none is a training seed."""
    args = ppo.Args(group_size=4)
    train = ppo.row_keys(args, 3, 0, 0, 8, args.group_size)
    assert train[:4] == [train[0]] * 4 and train[4] != train[0]  # a group: one task, four tries
    held_out = ppo.evaluation_seeds(args, 8)
    assert len(set(held_out)) == 8 and not set(held_out) & set(train)
    calls, real_sample = [], ppo.sample
    monkeypatch.setattr(ppo, "sample", lambda models, a, rows, ids, idx, seeds, *r, **k: (
        calls.append((a.eval_every and rows is not None and len(rows) == 8, list(idx), seeds)),
        real_sample(models, a, rows, ids, idx, seeds, *r, **k))[1])
    shutil.rmtree("runs/test_eval_seeds", ignore_errors=True)
    run = ppo.Args(env=f"{ENVS}:Replies", max_turns=2, total_episodes=32, batch_size=16, num_ppo_epochs=1,
                   eval_every=1, eval_size=8, eval_samples=2, save_every=0, sample_every=0, run_name="test_eval_seeds")
    ppo.main(run)
    evals = [(idx, seeds) for is_eval, idx, seeds in calls if is_eval]
    assert len(evals) == 2 and evals[0] == evals[1]  # updates 1 and 2: the same games
    idx, seeds = evals[0]
    assert seeds == [ppo.evaluation_seeds(run, 8)[j] for j in idx]  # prompt j's seed, whoever evaluates it


@pytest.mark.fast
def test_a_template_that_refuses_the_first_messages_gets_one_line():
    tok = AutoTokenizer.from_pretrained(real_models.tokenizer_dir("mistral"))  # user and assistant only, alternating
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "guess 1 16 ?"}]
    with pytest.raises(ppo.UsageError, match="cannot render reset\\(\\)'s observation \\(Conversation roles"):
        ppo.first_observation(tok, messages, ppo.Args(env="x.py:E"))
