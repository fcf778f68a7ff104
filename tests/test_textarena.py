"""--env textarena/GAME: a single-player TextArena game through the env interface, offline."""
import json
import shutil

import pytest

import ppo
import adapters
from fp32 import ratio_tolerance

pytestmark = pytest.mark.fast
GAME = "GuessTheNumber-v0"  # 1..20 in 10 turns; a guess is a number in square brackets


def play_binary_search(seed):
    """A TextArena GuessTheNumber episode through the adapter, by binary search on its replies."""
    env, lo, hi = adapters.textarena_game(GAME)(), 1, 20
    first = env.reset({"game": GAME}, seed)
    replies = []
    for _ in range(10):
        guess = (lo + hi) // 2
        observation, reward, done = env.step(f"[{guess}]")
        if done:
            return first, replies, reward, guess
        assert "[Player]" not in observation and guess_line(observation) in ("higher", "lower")
        replies.append(observation)
        lo, hi = (guess + 1, hi) if guess_line(observation) == "higher" else (lo, guess - 1)
    return first, replies, None, None


def guess_line(observation):
    return observation.rstrip(".").split()[-1]


def test_a_textarena_game_plays_through_the_adapter():
    first, replies, reward, secret = play_binary_search(seed=3)
    assert "Guess The Number" in first and "between 1 and 20" in first
    assert reward == 1.0 and all(r.startswith("[GAME] The target number is") for r in replies)
    assert play_binary_search(seed=3)[3] == secret  # the seed draws the task: a resumed run replays it
    assert len({play_binary_search(seed=s)[3] for s in range(8)}) > 2


def test_the_echo_of_a_move_is_left_out_whatever_its_lines():
    env = adapters.textarena_game(GAME)()
    env.reset({"game": GAME}, 3)
    observation, reward, done = env.step("I think\n[1]\nis my guess, or [2]")  # (the secret is 8 at seed 3)
    assert not done and observation == "[GAME] The target number is higher."
    observation, _, done = env.step("no number")  # the first invalid move gets a warning (the second loses)
    assert not done and observation.startswith("[GAME] You attempted an invalid move") and "no number" not in observation


def test_the_echo_is_left_out_where_the_game_logs_it_as_its_own():
    env = adapters.textarena_game("TowerOfHanoi-v0")()  # logs the move under the game's id, of kind PLAYER_ACTION
    env.reset({"game": "TowerOfHanoi-v0"}, 3)
    observation, _, done = env.step("[A C]")
    assert not done and "[GAME] [A C]" not in observation and "You moved disk 1 from A to C" in observation


def test_a_short_run_on_a_textarena_game(monkeypatch):
    shutil.rmtree("runs/test_textarena", ignore_errors=True)
    ppo.main(ppo.Args(env=f"textarena/{GAME}", max_turns=2, response_length=4, total_episodes=16, batch_size=8,
                      num_ppo_epochs=1, save_every=0, sample_every=1, run_name="test_textarena"))
    rows = [json.loads(line) for line in open("runs/test_textarena/metrics.jsonl")]
    tol = ratio_tolerance("runs/toy/policy")
    assert len(rows) == 2 and all(r["ppo/policy/ratio_at_start"] < tol and r["env/turns"] >= 1 for r in rows)
    sample = json.loads(open("runs/test_textarena/samples.jsonl").readline())  # (the toy's vocabulary: mostly <unk>)
    assert sample["prompt"] and sample["response"]


@pytest.mark.parametrize("game, cause", [("Wordle-v0", "the game needs a corpus this machine lacks: Resource 'words' not found"),
                                         ("Klondike-v0", "TextArena's own code for it does not compile")])
def test_a_game_that_cannot_run_here_names_the_cause(game, cause):
    pytest.importorskip("nltk")  # (TextArena's Wordle needs it; a machine with its corpus would make the game)
    with pytest.raises(ValueError, match=cause):  # (ppo.py says it as "--env textarena/GAME: " + the cause)
        adapters.textarena_game(game)


def test_an_unknown_game_gets_one_line():
    with pytest.raises(ppo.UsageError, match="--env textarena/NoSuchGame-v0: Environment NoSuchGame-v0 not found"):
        ppo.main(ppo.Args(env="textarena/NoSuchGame-v0", total_episodes=8, batch_size=8, save_every=0,
                          run_name="test_textarena_bad"))
