"""The third built-in world (`python ppo.py --model guess`): a multi-turn game against an environment,
guess-the-number with higher/lower replies, where binary search is optimal. Built on first use, without
network, in about two minutes on 2 cores, and cached as an ordinary HF checkpoint under `runs/guess/`.

    <bos> guess 1 16 ?   8 <eos>   higher   12 <eos>   lower   10 <eos>
    |---- OBS0 -------|  |ACT1 --|  |OBS1|   |ACT2 --|  |OBS2|  |ACT3 --|   secret 10: reward 1, done

The environment (`--env guess:Guess`, rows from `Guess.rows`) draws a secret in LO..HI and answers
each guess with "higher" or "lower"; the guess of the secret ends the episode with reward 1, every
other step gives 0, and ppo.py cuts an episode not done after --max-turns (a failure), so the return
is the success. Anything but one number in LO..HI is answered "invalid" (reward 0, not done).
Binary search (the midpoint of the interval still consistent with the replies) finds any of the 16
numbers in at most MAX_TURNS = 5 guesses (4 find at most 15): one wasted guess costs little, two cost
over half the secrets. Observations are raw text (no chat template): the first tokenized as usual
(`<bos>` first), later ones with add_special_tokens=False right after the agent's `<eos>`, its stop
token. A guess is 2 tokens, so an episode is at most 19 (29 with turns of RESPONSE_LENGTH tokens).

The starting policy (a 4-layer Llama, about 0.27M parameters) is pre-trained on the agent's tokens of
whole demonstration episodes whose every guess is the consistent midpoint with probability P_GOOD,
else a noisy one: mostly the last guess again (it ignores the last reply, a wasted turn), else a
random number (it ignores all of them). It starts near 30% success at temperature 0.7, in about 3 turns
(three quarters of the successes in 2 or more), and RL has one thing to learn: to follow the replies.
"""
import json
import math
import os
import random
import re

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
LO, HI = 1, 16
NUMBERS = [str(k) for k in range(LO, HI + 1)]
VOCAB = SPECIALS + NUMBERS + ["guess", "?", "higher", "lower", "invalid"]
MAX_TURNS = 5  # binary search needs at most ceil(log2(HI - LO + 2)) = 5 guesses
RESPONSE_LENGTH = 4  # tokens per agent turn, EOS included (a guess is 2)
ENV = "guess:Guess"
P_GOOD = 0.3  # chance that a demonstrated guess is the consistent midpoint
P_REPEAT = 2 / 3  # share of the other guesses (after the first) that repeat the last one, the rest random:
# random guesses alone still inform, and sampling at 0.7 sharpens them away (the start would be over 60%)
VERSION = 1  # bump to rebuild cached worlds after a change here


class Guess:
    """One episode of the game; `reset` then `step` until done (ppo.py cuts it at --max-turns)."""

    def reset(self, row: dict, seed: int) -> str:
        self.lo, self.hi = int(row.get("lo", LO)), int(row.get("hi", HI))
        # a row without a secret (a --dataset without that column) gets one from the trainer's seed
        self.secret = int(row["secret"]) if "secret" in row else random.Random(seed).randint(self.lo, self.hi)
        assert LO <= self.lo <= self.secret <= self.hi <= HI, f"the vocabulary has the numbers {LO}..{HI} only"
        self.done = False
        return f"guess {self.lo} {self.hi} ?"

    def step(self, action_text: str) -> tuple[str | None, float, bool]:
        assert not self.done, "step after the end of the episode"
        words = action_text.split()
        if len(words) != 1 or not re.fullmatch(r"[0-9]+", words[0]) or not self.lo <= int(words[0]) <= self.hi:
            return "invalid", 0.0, False
        k = int(words[0])
        if k == self.secret:
            self.done = True
            return None, 1.0, True
        return ("higher" if k < self.secret else "lower"), 0.0, False

    @staticmethod
    def rows(n: int, seed: int) -> list[dict]:
        rng = random.Random(seed)
        return [{"lo": LO, "hi": HI, "secret": rng.randint(LO, HI)} for _ in range(n)]


class GuessSteps(Guess):
    """Guess with a reward at every turn (`--env guess:GuessSteps`, for experiments/run.py guesssteps): each
    reply pays the share of the game's bits it gave, log2 of the numbers still consistent with the replies
    before the guess over those after, over log2 of the 16; the right guess pays the bits still missing
    plus Guess's 1. The bits missing are a potential (Ng et al. 1999), so the step rewards telescope: a
    success returns 2 whatever its path, a failure what its replies taught it (less than 1), and the
    episode's success is still the share the env ended."""

    def reset(self, row: dict, seed: int) -> str:
        first = super().reset(row, seed)
        self.left = (self.lo, self.hi)  # the numbers still consistent with the replies
        return first

    def step(self, action_text: str) -> tuple[str | None, float, bool]:
        observation, reward, done = super().step(action_text)
        (lo, hi), k = self.left, int(action_text.split()[0]) if observation != "invalid" else None
        if done:
            self.left = (self.secret, self.secret)
        elif observation == "higher":
            self.left = (max(lo, k + 1), hi)
        elif observation == "lower":
            self.left = (lo, min(hi, k - 1))
        gained = math.log2((hi - lo + 1) / (self.left[1] - self.left[0] + 1)) / math.log2(HI - LO + 1)
        return observation, reward + gained, done


def demonstration(secret: int, rng: random.Random, p_good: float = P_GOOD) -> list[tuple[str, str | None]]:
    """(guess, reply) pairs of a noisy binary search, up to MAX_TURNS; no reply (None) after the last guess."""
    lo, hi, turns = LO, HI, []
    for _ in range(MAX_TURNS):
        mid = (lo + hi) // 2
        if rng.random() < p_good:
            k = mid
        elif turns and rng.random() < P_REPEAT:
            k = int(turns[-1][0])  # ignores the last reply: a wasted turn
        else:
            k = rng.randint(LO, HI)  # ignores all the replies
        if k == secret:
            return turns + [(str(k), None)]
        turns.append((str(k), "higher" if k < secret else "lower"))
        lo, hi = (max(lo, k + 1), hi) if k < secret else (lo, min(hi, k - 1))
    return turns[:-1] + [(turns[-1][0], None)]  # cut at MAX_TURNS: the episode ends on the agent's <eos>


def episode_ids(tok, secret: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """Token ids of a demonstration, laid out as ppo.py lays out episodes, and its labels (agent tokens only)."""
    ids = tok(f"guess {LO} {HI} ?").input_ids  # <bos> first
    labels = [-100] * len(ids)
    for k, reply in demonstration(secret, rng):
        ids += [tok.convert_tokens_to_ids(k), tok.eos_token_id]
        labels += ids[-2:]
        if reply is not None:
            ids.append(tok.convert_tokens_to_ids(reply))
            labels.append(-100)
    return ids, labels


def sft_texts(n: int, seed: int = 99) -> list[str]:
    """Whole demonstrations as text, read as ppo.py lays episodes out (the PPO-ptx set of this world)."""
    rng = random.Random(seed)
    return [" ".join([f"guess {LO} {HI} ?"] + [f"{k} <eos> {r or ''}".strip() for k, r in
                                                 demonstration(rng.randint(LO, HI), rng)]) for _ in range(n)]


def make_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>", padding_side="left")


def make_config(tok, hidden=64, layers=4) -> LlamaConfig:
    return LlamaConfig(vocab_size=len(VOCAB), hidden_size=hidden, intermediate_size=4 * hidden,
                       num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
                       max_position_embeddings=64, tie_word_embeddings=False, num_labels=1,
                       pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                       bos_token_id=tok.bos_token_id)


def pretrain(tok, cfg, rng, steps, batch=64, log=print):
    """Next-token loss on the agent's tokens of whole demonstrations (the observations are given, not learned)."""
    model = AutoModelForCausalLM.from_config(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    for step in range(steps):
        eps = [episode_ids(tok, rng.randint(LO, HI), rng) for _ in range(batch)]
        width = max(len(ids) for ids, _ in eps)
        input_ids = torch.tensor([ids + [tok.pad_token_id] * (width - len(ids)) for ids, _ in eps])  # (B, L)
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in eps])  # (B, L)
        loss = model(input_ids=input_ids, attention_mask=input_ids != tok.pad_token_id, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if (step + 1) % 200 == 0:
            log(f"  guess world: pre-training step {step + 1}/{steps}, loss {loss.item():.3f}")
    return model.eval(), loss.item()


@torch.no_grad()
def success_rate(model, tok, n=512, seed=7, temperature=0.7, max_turns=MAX_TURNS) -> dict:
    """Sampled episodes played turn by turn as ppo.py plays them: the success rate, the mean turns of a
    success, and the share of successes that took 2 or more turns."""
    torch.manual_seed(seed)
    envs = [Guess() for _ in range(n)]
    ctx = [tok(env.reset(row, seed + i)).input_ids for i, (env, row) in enumerate(zip(envs, Guess.rows(n, seed)))]
    turns = [0] * n
    active = list(range(n))
    for _ in range(max_turns):
        if not active:
            break
        width = max(len(ctx[i]) for i in active)
        pad = [[tok.pad_token_id] * (width - len(ctx[i])) for i in active]  # left padding: generate appends
        ids = torch.tensor([p + ctx[i] for p, i in zip(pad, active)])  # (B, W)
        out = model.generate(input_ids=ids, attention_mask=ids != tok.pad_token_id, do_sample=True,
                             temperature=temperature, top_k=0, max_new_tokens=RESPONSE_LENGTH,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[:, width:]  # (B, <= R)
        still = []
        for i, new in zip(active, out.tolist()):
            if tok.eos_token_id not in new:
                continue  # cut by the turn's length limit: a failure
            new = new[:new.index(tok.eos_token_id) + 1]
            obs, _, done = envs[i].step(tok.decode(new, skip_special_tokens=True))
            ctx[i] += new
            turns[i] += 1
            if not done:
                ctx[i] += tok(obs, add_special_tokens=False).input_ids
                still.append(i)
        active = still
    wins = [turns[i] for i in range(n) if envs[i].done]
    return {"success": len(wins) / n, "turns": sum(wins) / max(1, len(wins)),
            "multi_turn_share": sum(t >= 2 for t in wins) / max(1, len(wins))}


def build_world(root: str = "runs/guess", seed: int = 0, steps: int = 2000, log=print) -> tuple[str, None]:
    """Build (or reuse) the guess world's policy; returns its path and None (the reward comes from the env)."""
    policy_dir, stamp = os.path.join(root, "policy"), os.path.join(root, "world.json")
    if os.path.exists(stamp) and json.load(open(stamp)).get("version") == VERSION:
        return policy_dir, None
    log(f"building the guess world in {root}/ (once; about two minutes on a laptop CPU)")
    with torch.random.fork_rng():  # leave the caller's random stream as it was
        torch.manual_seed(seed)
        rng = random.Random(seed)
        tok = make_tokenizer()
        policy, loss = pretrain(tok, make_config(tok), rng, steps, log=log)
        stats = success_rate(policy, tok)
    policy.save_pretrained(policy_dir)
    tok.save_pretrained(policy_dir)
    with open(stamp, "w") as f:  # written last: a half-built world is rebuilt
        json.dump({"version": VERSION, "loss": loss, **stats}, f)
    log(f"guess world: loss {loss:.3f}, sampled success {stats['success']:.2f} within {MAX_TURNS} turns, "
        f"{stats['turns']:.1f} turns a success, {stats['multi_turn_share']:.0%} of them in 2 or more")
    return policy_dir, None


if __name__ == "__main__":
    build_world()
