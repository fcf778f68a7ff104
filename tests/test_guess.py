"""The guess world (guess.py), multi-turn: its environment's replies, binary search winning within its
turns, and a few updates of `ppo.py --model guess` on a small world built in the test."""
import json
import math
import shutil

import pytest

import guess
import ppo
from fp32 import ratio_tolerance


def play(env, policy, row, turns=guess.MAX_TURNS):
    """Turns of `policy(history) -> guess text` until done: the number of turns, or None if not won."""
    history = [env.reset(row, 0)]
    for turn in range(1, turns + 1):
        action = policy(history)
        observation, reward, done = env.step(action)
        assert (reward == 1.0) == done
        if done:
            return turn
        history += [action, observation]
    return None


def binary_search(history):
    lo, hi = guess.LO, guess.HI
    for action, reply in zip(history[1::2], history[2::2]):
        k = int(action)
        lo, hi = (k + 1, hi) if reply == "higher" else (lo, k - 1) if reply == "lower" else (lo, hi)
    return str((lo + hi) // 2)


@pytest.mark.fast
def test_the_env_replies_higher_lower_and_invalid():
    env = guess.Guess()
    assert env.reset({"secret": 10}, 0) == f"guess {guess.LO} {guess.HI} ?"
    assert env.step("8") == ("higher", 0.0, False)
    assert env.step("12") == ("lower", 0.0, False)
    for bad in ("", "ten", "8 9", "0", str(guess.HI + 1), "<eos>"):
        assert env.step(bad) == ("invalid", 0.0, False)
    assert env.step("10") == (None, 1.0, True)


@pytest.mark.fast
def test_binary_search_wins_every_secret_within_the_turns_and_most_need_two():
    turns = [play(guess.Guess(), binary_search, {"secret": s}) for s in range(guess.LO, guess.HI + 1)]
    assert None not in turns and max(turns) == guess.MAX_TURNS
    assert sum(t >= 2 for t in turns) >= 0.9 * len(turns)
    assert play(guess.Guess(), lambda h: "8", {"secret": 3}) is None  # ignoring the replies loses


@pytest.mark.fast
def test_the_reward_at_every_turn_telescopes_to_the_bits_the_replies_gave():
    for secret in range(guess.LO, guess.HI + 1):  # binary search and a wasteful linear search both return 2
        for policy in (binary_search, lambda h: str(guess.LO + len(h) // 2)):
            env, rewards, history = guess.GuessSteps(), [], [None]
            env.reset({"secret": secret}, 0)
            for _ in range(guess.HI):
                action = policy(history)
                observation, reward, done = env.step(action)
                rewards.append(reward)
                if done:
                    break
                history += [action, observation]
            assert done and sum(rewards) == pytest.approx(2.0)
    env = guess.GuessSteps()
    env.reset({"secret": 3}, 0)
    steps = [env.step(a) for a in ("x", "8", "8", "2")]  # 1..7 left after "lower", then 3..7 after "higher"
    assert [r for _, r, _ in steps] == pytest.approx([0.0, math.log2(16 / 7) / 4, 0.0, math.log2(7 / 5) / 4])


@pytest.mark.mutants  # outside the fast subset for its time; the mutation check runs it
def test_a_few_updates_of_the_guess_world(tmp_path, monkeypatch):
    small = guess.build_world(str(tmp_path / "guess"), steps=150, log=lambda *a: None)
    monkeypatch.setattr(guess, "build_world", lambda *a, **k: small)
    shutil.rmtree("runs/test_guess", ignore_errors=True)
    ppo.main(ppo.Args(model="guess", run_name="test_guess", total_episodes=64, batch_size=32, num_ppo_epochs=1,
                      sample_every=1, save_every=0))
    config = json.load(open("runs/test_guess/config.json"))
    assert (config["env"], config["max_turns"], config["response_length"]) == \
        (guess.ENV, guess.MAX_TURNS, guess.RESPONSE_LENGTH)
    rows = [json.loads(line) for line in open("runs/test_guess/metrics.jsonl")]
    assert len(rows) == 2 and all(1 <= r["env/turns"] <= guess.MAX_TURNS for r in rows)
    tol = ratio_tolerance(small[0])
    assert all(r["ppo/policy/ratio_at_start"] < tol and r["objective/env"] == r["ppo/val/eos_rate"] for r in rows)
    words = [json.loads(line)["response"].split() for line in open("runs/test_guess/samples.jsonl")]
    assert any(w and w[0].isdigit() for w in words)  # the episode: a guess first, then a reply, ... (a sample that
    # ends at once has no words: which do is the sampler's, on a world each CPU trains)
