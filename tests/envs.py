"""Environments for the tests of multi-turn episodes (--env tests/envs.py:NAME), on the toy world's words."""
import math

LOG = []  # (seed, turn, action text, observation, reward) of every step, for the tests to check


class Replies:
    """Three turns, a reply after each that grows by a clause a turn; a step's reward is 0.1 x the turn,
    plus 1 for a turn that says "great". The episode ends after the third turn."""
    turns = 3

    @staticmethod
    def rows(n, seed):
        return [{"prompt": "the movie was", "id": i} for i in range(n)]

    def reset(self, row, seed):
        self.seed, self.turn = seed, 0
        return row["prompt"]

    def step(self, action_text):
        self.turn += 1
        observation = " ".join(["i think the pizza was"] * self.turn)
        reward = 0.1 * self.turn + float("great" in action_text.split())
        LOG.append((self.seed, self.turn, action_text, observation, reward))
        return observation, reward, self.turn >= self.turns


class Long(Replies):
    """Eight turns, its replies growing: past the toy model's 128 positions."""
    turns = 8


class OneTurn(Replies):
    """One turn whose reward is tests/envs.py:great_reward: the same rows as --reward-fn with it."""

    @staticmethod
    def rows(n, seed):
        import toy
        return [{"prompt": p} for p in toy.prompts(n, seed=seed)]

    def reset(self, row, seed):
        self.prompt = row["prompt"]
        return row["prompt"]

    def step(self, action_text):
        return None, great_reward([self.prompt], [action_text])[0], True


def great_reward(prompts, responses, **columns):
    return [float("great" in r.split()) - 0.1 * len(r.split()) for r in responses]


class Bad(Replies):
    """A broken env: BAD names what is wrong with it (set by the test)."""
    BAD = None

    def __init__(self):
        if self.BAD == "the constructor raises":
            raise RuntimeError("no levels installed")

    def reset(self, row, seed):
        if self.BAD == "reset raises":
            raise ValueError("no such level")
        return super().reset(row, seed)

    def step(self, action_text):
        observation, reward, done = super().step(action_text)
        return {"step raises": lambda: 1 / 0, "a list": lambda: [observation, reward, done],
                "two values": lambda: (observation, reward), "nan reward": lambda: (observation, math.nan, done),
                "text reward": lambda: (observation, "1", done), "done is 1": lambda: (observation, reward, 1),
                "None while not done": lambda: (None, reward, False),
                "a huge observation": lambda: ("the " * 400, reward, done),
                }.get(self.BAD, lambda: (observation, reward, done))()


class NoRows:
    def reset(self, row, seed):
        return "the movie was"

    def step(self, action_text):
        return None, 0.0, True


class Uneven(Replies):
    """Episodes of 1 to 4 turns, set by the seed: under torchrun one rank's may all be over before the other's."""

    def reset(self, row, seed):
        self.turns = 1 + seed % 4
        return super().reset(row, seed)


class Silent(Replies):
    """Replies whose observations are empty: on the toy's raw text no token lies between two turns."""

    def step(self, action_text):
        _, reward, done = super().step(action_text)
        return "", reward, done


class NoRowsAtAll(NoRows):
    @staticmethod
    def rows(n, seed):
        return []
