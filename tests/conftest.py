import fcntl
import functools
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.chdir(ROOT)  # ppo.py and toy.py write under runs/ relative to the repository root

if os.environ.get("PYTEST_XDIST_WORKER"):  # tests/pytest.ini runs the files on a worker per core (pytest-xdist):
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread each, in this process and the runs it starts

import pytest  # noqa: E402
import torch  # noqa: E402

import real_models  # noqa: E402
import toy  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def one_builder_at_a_time(build):
    """`build` under an exclusive lock on runs/.build.lock: two workers that want the same cached checkpoint on a
    fresh clone wait for one to build it instead of writing one folder together (a build inside a build is free)."""
    held = []

    @functools.wraps(build)
    def locked(*args, **kwargs):
        if held:
            return build(*args, **kwargs)
        os.makedirs("runs", exist_ok=True)
        with open("runs/.build.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            held.append(True)
            try:
                return build(*args, **kwargs)
            finally:
                held.pop()
    return locked


toy.build_world = one_builder_at_a_time(toy.build_world)
real_models.build = one_builder_at_a_time(real_models.build)


# the files that take longest, longest first (2026-12-04, 2 cores): pytest-xdist hands out whole files in the order
# collected, and a long file handed out last would run on alone while the other workers sit idle
LONGEST_FIRST = ["test_reliability.py", "test_fsdp.py", "test_multiturn.py", "test_real_models.py", "test_vllm.py",
                 "test_chain.py", "test_in_process.py", "test_lora.py", "test_smollm2.py", "test_bad_input.py"]


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: LONGEST_FIRST.index(item.path.name) if item.path.name in LONGEST_FIRST
               else len(LONGEST_FIRST))  # (stable: the others in their own order)


@pytest.fixture(scope="session", autouse=True)
def world():
    """The toy world's (policy, reward) checkpoint paths, built once and cached under runs/toy/: before any test,
    so that no run a test starts in a process of its own finds it missing and builds it beside another."""
    return toy.build_world()
