import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.chdir(ROOT)  # ppo.py and toy.py write under runs/ relative to the repository root


@pytest.fixture(scope="session")
def world():
    """The toy world's (policy, reward) checkpoint paths, built once and cached under runs/toy/."""
    import toy
    return toy.build_world()
