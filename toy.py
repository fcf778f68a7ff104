"""The embedded default world: short synthetic reviews, a hidden gold judge, and a reward model
that only approximates it. Everything is built on the CPU, once, with no network, and
cached as ordinary HF checkpoints under `runs/toy/` so ppo.py loads it like any other model.

    prompt    "<bos> i think the pizza was"
    response  "great and very dull ."  <eos>

Gold (hidden from the policy, and only approximated by the reward model):
    gold = well_formed(response) * fraction of its adjectives that are positive, in [0, 1]
    well_formed: ADJP ((and | but) ADJP)* "." then EOS, with ADJP = ["very"] ADJ, one to four
    adjectives, none repeated.
The SFT corpus picks positive adjectives 40% of the time, so the SFT policy scores about 0.4.
The reward model learns the gold order from preference pairs, a fifth of which are malformed, so
it knows the rules only roughly: maximising it without a KL penalty can drift into text that it
likes and gold does not (repeats, long lists), the over-optimisation of Gao et al. 2022.
"""
import json
import os
import random

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig,
                          PreTrainedTokenizerFast)

NOUNS = ["movie", "book", "pizza", "hotel", "phone", "game", "song", "park"]
POSITIVE = ["good", "great", "nice", "fun", "lovely", "superb", "fine", "cool"]
NEGATIVE = ["bad", "dull", "awful", "poor", "boring", "weak", "sad", "slow"]
TEMPLATES = ["the {} was", "my {} is", "i think the {} was", "here is my review of the {} :"]
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
WORDS = ["the", "was", "is", "my", "i", "think", "here", "review", "of", ":", "very", "and", "but", "."]
VOCAB = SPECIALS + WORDS + NOUNS + POSITIVE + NEGATIVE
MAX_ADJECTIVES = 4
VERSION = 2  # bump to rebuild cached worlds after a change here


def gold(response: str) -> float:
    """The hidden judge: well-formed x fraction of positive adjectives, in [0, 1].
    `response` is the decoded text up to and including the EOS (no EOS: truncated, not well-formed)."""
    words = response.split()
    if len(words) < 3 or words[-2:] != [".", "<eos>"]:
        return 0.0
    adjectives, expect_adj, i = [], True, 0
    for w in words[:-2]:
        if expect_adj and w == "very":
            continue  # "very" may precede an adjective
        if expect_adj and (w in POSITIVE or w in NEGATIVE):
            adjectives.append(w)
        elif not expect_adj and w in ("and", "but"):
            pass
        else:
            return 0.0
        expect_adj = not expect_adj
    if expect_adj or len(adjectives) > MAX_ADJECTIVES or len(set(adjectives)) < len(adjectives):
        return 0.0  # ends on a conjunction, too long, or repeats itself
    return sum(a in POSITIVE for a in adjectives) / len(adjectives)


def gold_reward(prompts, responses, **columns) -> list[float]:
    """The gold judge as a --reward-fn (`--reward-fn toy:gold_reward`). The trainer passes responses
    decoded without special tokens; those cut by the length limit get its missing-EOS penalty
    instead, so every response scored here ended with EOS."""
    return [gold(r + " <eos>") for r in responses]


CLOSED = True  # 32 prompts in all, each among the training rows: ppo.py evaluates on training prompts here


def prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [rng.choice(TEMPLATES).format(rng.choice(NOUNS)) for _ in range(n)]


def sft_texts(n: int, seed: int = 99) -> list[str]:
    """Prompt + response texts from the SFT distribution (the PPO-ptx set of the toy world)."""
    rng = random.Random(seed)
    return [p + " " + sample_response(rng) for p in prompts(n, seed)]


def sample_response(rng: random.Random, p_positive: float = 0.4) -> str:
    """A well-formed review from the SFT distribution."""
    k = rng.choice([1, 1, 2, 2, 2, 3])
    pos = rng.sample(POSITIVE, k)
    neg = rng.sample(NEGATIVE, k)
    adjectives = [pos[i] if rng.random() < p_positive else neg[i] for i in range(k)]
    parts = []
    for i, a in enumerate(adjectives):
        if i > 0:
            parts.append(rng.choice(["and", "but"]))
        parts.append(("very " + a) if rng.random() < 0.2 else a)
    return " ".join(parts) + " . <eos>"


def corrupt(rng: random.Random, response: str) -> str:
    """A malformed variant, so the reward model sees some of gold's rules (not all of them)."""
    words = response.split()[:-2]  # drop ". <eos>"
    kind = rng.randrange(4)
    if kind == 0:  # repeat an adjective
        adj = [w for w in words if w in POSITIVE or w in NEGATIVE]
        words += [rng.choice(["and", "but"]), rng.choice(adj)]
    elif kind == 1:  # too many adjectives
        words += [x for a in rng.sample(POSITIVE + NEGATIVE, 3) for x in ("and", a)]
    elif kind == 2:  # no full stop, or a dangling conjunction
        return " ".join(words + (["and"] if rng.random() < 0.5 else [])) + " <eos>"
    else:  # a stray word
        words.insert(rng.randrange(len(words) + 1), rng.choice(WORDS + NOUNS))
    return " ".join(words) + " . <eos>"


def make_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>", padding_side="left")


def make_config(tok, hidden=64, layers=2) -> LlamaConfig:
    return LlamaConfig(vocab_size=len(VOCAB), hidden_size=hidden, intermediate_size=4 * hidden,
                       num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,  # head_dim 32: vLLM's CPU attention needs >= 32
                       max_position_embeddings=128, tie_word_embeddings=False, num_labels=1,
                       pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                       bos_token_id=tok.bos_token_id)


def encode(tok, texts):  # right-padded batch for the warm-up training below
    return tok(texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=True)


def train_sft(tok, cfg, rng, steps=500, batch=64, log=print):
    model = AutoModelForCausalLM.from_config(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(steps):
        texts = [p + " " + sample_response(rng) for p in prompts(batch, seed=rng.random())]
        enc = encode(tok, texts)
        labels = enc.input_ids.masked_fill(enc.attention_mask == 0, -100)  # (B, L)
        loss = model(**enc, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % 100 == 0:
            log(f"  toy world: policy, supervised step {step + 1}/{steps}, loss {loss.item():.3f}")
    return model, loss.item()


def reward_pair(rng):
    """Two responses to one prompt with different gold; a fifth of them malformed."""
    while True:
        a, b = (corrupt(rng, r) if rng.random() < 0.2 else r for r in (sample_response(rng, 0.5),
                                                                         sample_response(rng, 0.5)))
        if gold(a) != gold(b):
            return (a, b) if gold(a) > gold(b) else (b, a)


def train_reward(tok, cfg, rng, steps=600, batch=64, log=print):
    """Bradley-Terry on gold-labelled pairs; the centering term keeps scores near mean 0
    (Eisenstein et al. 2023), so a missing-EOS penalty of -1 sits below a typical score."""
    model = AutoModelForSequenceClassification.from_config(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for step in range(steps):
        ps = prompts(batch, seed=rng.random())
        pairs = [reward_pair(rng) for _ in range(batch)]
        enc = encode(tok, [p + " " + w for p, (w, _) in zip(ps, pairs)] + [p + " " + l for p, (_, l) in zip(ps, pairs)])
        r = model(**enc).logits[:, 0]  # (2B,): chosen then rejected
        loss = -F.logsigmoid(r[:batch] - r[batch:]).mean() + 0.01 * (r ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % 100 == 0:
            log(f"  toy world: reward model, step {step + 1}/{steps} on {batch} preference pairs, loss {loss.item():.3f}")
    with torch.no_grad():  # accuracy on fresh pairs
        ps = prompts(512, seed=rng.random())
        pairs = [reward_pair(rng) for _ in range(512)]
        enc = encode(tok, [p + " " + w for p, (w, _) in zip(ps, pairs)] + [p + " " + l for p, (_, l) in zip(ps, pairs)])
        r = model(**enc).logits[:, 0]
        acc = (r[:512] > r[512:]).float().mean().item()
    return model, acc


def build_world(root: str = "runs/toy", seed: int = 0, log=print) -> tuple[str, str]:
    """Build (or reuse) the toy policy and reward model; returns their checkpoint paths."""
    policy_dir, reward_dir = os.path.join(root, "policy"), os.path.join(root, "reward")
    stamp = os.path.join(root, "world.json")
    if os.path.exists(stamp) and json.load(open(stamp)).get("version") == VERSION:
        return policy_dir, reward_dir
    log(f"building the toy world in {root}/ (once; each step is printed)")
    with torch.random.fork_rng():  # leave the caller's random stream as it was
        torch.manual_seed(seed)
        rng = random.Random(seed)
        tok = make_tokenizer()
        cfg = make_config(tok)
        policy, sft_loss = train_sft(tok, cfg, rng, log=log)
        reward, acc = train_reward(tok, cfg, rng, log=log)
    for model, path in ((policy, policy_dir), (reward, reward_dir)):
        model.save_pretrained(path)
        tok.save_pretrained(path)
    with open(stamp, "w") as f:  # written last: a half-built world is rebuilt
        json.dump({"version": VERSION, "sft_loss": sft_loss, "reward_accuracy": acc}, f)
    log(f"toy world: SFT loss {sft_loss:.3f}, reward model pair accuracy {acc:.3f}")
    return policy_dir, reward_dir


if __name__ == "__main__":
    build_world()
