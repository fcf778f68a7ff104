"""The second built-in world (`python ppo.py --model chain`): a checkable answer at the end of a
worked solution of variable length, the regime of reasoning RL with verifiable rewards, small enough
for a laptop CPU. Built on first use, without network, in about two minutes on 2 cores, and cached as
an ordinary HF checkpoint under `runs/chain/`.

    prompt    "<bos> 3 1 4 1 5 ?"                          4 to 16 digits
    worked    "3 3 1 4 4 8 1 9 5 4 = 4 <eos>"              each digit, then the running sum mod 10
    direct    "= 7 <eos>"                                  a guess

The answer is the digits' sum mod 10, the digit after the first "="; the reward (`chain:reward`, a
plain --reward-fn) is 1 for the right digit right after "=" and then the end, else 0, on the last
token as always, so `objective/reward_fn` is the accuracy. A worked answer is 2 tokens per digit plus
3 (11 to 35 tokens, EOS included); a direct one is 3. ppo.py's defaults for this world: responses of
up to 40 tokens, the reward `chain:reward`, the critic a value head on the policy.

The starting policy (a 4-layer Llama, about 0.2M parameters) is pre-trained on a mix of the two:
60% direct guesses, which are right one time in ten, and 40% worked answers in which each step
slips with probability SLIP (a running sum off by one, which carries through to the answer), so
long worked answers fail more often than short ones. It starts near 30% accuracy with two length
modes, and RL has two things to learn: to work the answer out, and to stop slipping. The critic
starts, by default, as a fresh value head on this policy (`--critic-init policy`, what a user
without a reward model has); `--critic-warmup-updates` pre-trains it (VAPO's value pre-training).
"""
import json
import os
import random
import re

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
DIGITS = [str(d) for d in range(10)]
VOCAB = SPECIALS + DIGITS + ["?", "="]
MIN_DIGITS, MAX_DIGITS = 4, 16
P_WORKED = 0.4  # share of worked answers in the pre-training mix
SLIP = 0.10  # chance that a step of a worked demonstration is off by one (about 3% a step sampled at T 0.7)
VERSION = 1  # bump to rebuild cached worlds after a change here


def answer(prompt: str) -> int:
    """The sum of the prompt's digits, mod 10."""
    return sum(int(d) for d in re.findall(r"\d", prompt)) % 10


def correct(prompt: str, response: str) -> bool:
    """The response (decoded without special tokens) is `... = a` with a the answer, and nothing after it."""
    words = response.split()
    if "=" not in words:
        return False
    after = words[words.index("=") + 1:]
    return after == [str(answer(prompt))]


def reward(prompts, responses, **columns) -> list[float]:
    """1 for the right answer after "=", else 0 (`--reward-fn chain:reward`, the world's default). A response
    cut by the length limit gets --missing-eos-penalty instead, as with any reward."""
    return [float(correct(p, r)) for p, r in zip(prompts, responses)]


def prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(DIGITS) for _ in range(rng.randint(MIN_DIGITS, MAX_DIGITS))) + " ?"
            for _ in range(n)]


def worked(prompt: str, rng: random.Random, slip: float = SLIP) -> str:
    """Each digit, then the running sum mod 10, each step off by one with probability `slip` (carried on)."""
    total, steps = 0, []
    for d in re.findall(r"\d", prompt):
        total = (total + int(d) + (rng.choice([-1, 1]) if rng.random() < slip else 0)) % 10
        steps += [d, str(total)]
    return " ".join(steps + ["=", str(total)])


def demonstration(prompt: str, rng: random.Random) -> str:
    if rng.random() < P_WORKED:
        return worked(prompt, rng)
    return f"= {rng.randrange(10)}"  # a guess: right one time in ten


def sft_texts(n: int, seed: int = 99) -> list[str]:
    """Prompt + response texts of the pre-training mix (the PPO-ptx set of this world)."""
    rng = random.Random(seed)
    return [p + " " + demonstration(p, rng) + " <eos>" for p in prompts(n, seed)]


def make_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>", padding_side="left")


def make_config(tok, hidden=64, layers=4) -> LlamaConfig:
    return LlamaConfig(vocab_size=len(VOCAB), hidden_size=hidden, intermediate_size=4 * hidden,
                       num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
                       max_position_embeddings=128, tie_word_embeddings=False, num_labels=1,
                       pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                       bos_token_id=tok.bos_token_id)


def pretrain(tok, cfg, rng, steps, batch=64, log=print):
    """Next-token loss on the responses of the mix (the prompts are given, not learned)."""
    model = AutoModelForCausalLM.from_config(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    for step in range(steps):
        ps = prompts(batch, seed=rng.random())
        enc = tok([p + " " + demonstration(p, rng) + " <eos>" for p in ps], return_tensors="pt", padding=True,
                  padding_side="right")
        prompt_len = torch.tensor([len(p.split()) + 1 for p in ps])  # <bos> and the prompt
        labels = enc.input_ids.masked_fill(enc.attention_mask == 0, -100)  # (B, L)
        labels[torch.arange(labels.shape[1])[None] < prompt_len[:, None]] = -100
        loss = model(**enc, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if (step + 1) % 200 == 0:
            log(f"  chain world: pre-training step {step + 1}/{steps}, loss {loss.item():.3f}")
    return model.eval(), loss.item()


@torch.no_grad()
def accuracy(model, tok, n=512, seed=7, temperature=0.7):
    """Sampled accuracy, the share of worked answers and their mean length, on fresh prompts."""
    torch.manual_seed(seed)
    ps = prompts(n, seed=seed)
    enc = tok(ps, return_tensors="pt", padding=True)
    out = model.generate(**enc, do_sample=True, temperature=temperature, top_k=0, max_new_tokens=40,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[:, enc.input_ids.shape[1]:]
    texts = tok.batch_decode(out, skip_special_tokens=False)
    right = [float("<eos>" in t and correct(p, t.split("<eos>")[0])) for p, t in zip(ps, texts)]
    lengths = [len(t.split("<eos>")[0].split()) + 1 for t in texts]
    is_worked = [not t.startswith("=") for t in texts]
    n_worked = max(1, sum(is_worked))
    return {"accuracy": sum(right) / n, "worked_share": sum(is_worked) / n,
            "worked_accuracy": sum(r for r, w in zip(right, is_worked) if w) / n_worked,
            "worked_length": sum(k for k, w in zip(lengths, is_worked) if w) / n_worked}


def build_world(root: str = "runs/chain", seed: int = 0, steps: int = 2000, log=print) -> tuple[str, None]:
    """Build (or reuse) the chain world's policy; returns its path and None (the reward is a function)."""
    policy_dir, stamp = os.path.join(root, "policy"), os.path.join(root, "world.json")
    if os.path.exists(stamp) and json.load(open(stamp)).get("version") == VERSION:
        return policy_dir, None
    log(f"building the chain world in {root}/ (once; about two minutes on a laptop CPU)")
    with torch.random.fork_rng():  # leave the caller's random stream as it was
        torch.manual_seed(seed)
        rng = random.Random(seed)
        tok = make_tokenizer()
        policy, loss = pretrain(tok, make_config(tok), rng, steps, log=log)
        stats = accuracy(policy, tok)
    policy.save_pretrained(policy_dir)
    tok.save_pretrained(policy_dir)
    with open(stamp, "w") as f:  # written last: a half-built world is rebuilt
        json.dump({"version": VERSION, "loss": loss, **stats}, f)
    log(f"chain world: loss {loss:.3f}, sampled accuracy {stats['accuracy']:.2f}, worked answers "
        f"{stats['worked_share']:.0%} of {stats['worked_length']:.0f} tokens, right {stats['worked_accuracy']:.0%}")
    return policy_dir, None


if __name__ == "__main__":
    build_world()
