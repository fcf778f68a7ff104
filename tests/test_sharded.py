"""Sharded checkpoints (torch.distributed.checkpoint, issue 55): a run saved on some number of ranks resumes on
another with its weights and AdamW states exactly as saved, and continues the same run, because every random draw
is keyed by a row's place in the global batch (`ppo.row_keys`, `ppo.minibatch_order`), not by its rank; two nodes
under a c10d rendezvous; a damaged, foreign or old checkpoint refused in one line and left as it was."""
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from fp32 import EPS
from test_fsdp import free_port, kill_tree, torchrun, without_timings

FLAGS = ["--total-episodes", "192", "--micro-batch-size", "16"]  # the toy world, 3 updates of 64 rollouts


def checkpoint_contents(step):
    """A checkpoint's shards read whole, in one process (torch's dcp_to_torch_save): {"policy": the weights that
    train, "policy_adamw": AdamW's state dict (keyed by parameter name), "critic": ..., "critic_adamw": ...}."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory() as d:
        dcp_to_torch_save(f"{step}/shards", f"{d}/whole.pt")
        return torch.load(f"{d}/whole.pt", weights_only=True)


def run(n, name, *flags):
    """A toy run on n ranks (torchrun, gloo): its metrics rows."""
    shutil.rmtree(f"runs/{name}", ignore_errors=True)
    out = torchrun(n, "ppo.py", "--run-name", name, *FLAGS, *flags)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in open(f"runs/{name}/metrics.jsonl")]


def assert_same_run(rows, ref):
    """Every metric of `rows` equals `ref`'s within fp32's rounding. A metric is a mean over the update's n trained
    tokens of terms of size about max(1, |metric|) (log-probs, ratios, the toy's values); another number of ranks
    adds them in other orders (other batch shapes, all-reduces), which moves such a mean by about
    sqrt(n) * eps * size (tests/fp32.py), and u updates of weights that carry such differences add u of them:
    8 sqrt(n u) eps max(1, |metric|). A clip fraction counts tokens past a threshold, where a token on the edge
    flips with any rounding: it may differ by 4 tokens in n. The samples must be the same tokens."""
    assert [r["step"] for r in rows] == [r["step"] for r in ref]
    for u, (row, want) in enumerate(zip(without_timings(rows), without_timings(ref)), 1):
        assert row.keys() == want.keys()
        n = want["time/trained_tokens"] if "time/trained_tokens" in want else 64 * 8
        for k, v in want.items():
            if not isinstance(v, float):
                assert row[k] == v, (u, k)
                continue
            tol = 4 / n if "clipfrac" in k else 8 * math.sqrt(n * u) * EPS * max(1.0, abs(v))
            assert abs(row[k] - v) <= tol, (u, k, row[k], v, tol)


@pytest.fixture(scope="module")
def saved(world):
    """The toy run on 2 ranks and on 1, checkpointed after every update."""
    flags = ["--save-every", "1", "--keep-checkpoints", "3"]
    return run(2, "test_shard_two", *flags), run(1, "test_shard_one", *flags)


@pytest.mark.parametrize("source,n", [("test_shard_two", 1), ("test_shard_two", 4), ("test_shard_one", 2)])
def test_a_checkpoint_loads_on_another_number_of_ranks_exactly(saved, source, n):
    """Update 3's checkpoint (the run's last) on n ranks: each weight and AdamW state equal to the checkpoint's shards,
    and each weight to the final models the run saved (issue 62: the shards alone would pass a save of the wrong
    state)."""
    out = torchrun(n, "tests/reshard_check.py", f"runs/{source}/checkpoints/step_3", *FLAGS)
    assert out.returncode == 0, out.stderr[-3000:]
    result = open(f"runs/{source}/reshard_{n}.txt").read()
    assert result.startswith("equal") and int(result.split()[1]) > 60, result  # weights (twice), m, v and steps


def test_one_two_and_four_ranks_continue_the_same_run(saved):
    two, one = saved
    assert_same_run(two, one)
    assert_same_run(run(4, "test_shard_four"), one)
    for n in (1, 4):  # update 1 on 2 ranks, then 2 and 3 on n: the run goes on as it would have
        resumed = run(n, f"test_shard_resumed_{n}", "--resume", "runs/test_shard_two/checkpoints/step_1")
        assert_same_run(resumed, one[1:])


@pytest.mark.mutants  # (a minute: outside the fast subset; the mutation check runs it)
def test_ppo_ptx_and_evaluation_are_the_same_run_on_one_and_two_ranks(world):
    """Issue 62: PPO-ptx's rows are drawn by (seed, update, epoch, minibatch), not by a rank's local offset, and its
    loss is a mean over every rank's tokens, not a mean of each rank's means: 4 minibatches on 1 rank and on 2. And
    5 evaluation prompts on 2 ranks are 5, not 4 (the last rank repeats one, uncounted)."""
    flags = ["--ptx-coef", "0.5", "--num-minibatches", "4", "--micro-batch-size", "8", "--eval-every", "3",
             "--eval-size", "5"]
    two, one = run(2, "test_shard_ptx_two", *flags), run(1, "test_shard_ptx_one", *flags)
    assert "eval/score" in one[-1]
    assert_same_run(two, one)


@pytest.mark.fast
def test_every_evaluation_prompt_is_counted_once_on_any_number_of_ranks():
    import ppo
    for n in range(1, 10):
        for world in range(1, 5):
            shares = [ppo.eval_share(n, rank, world) for rank in range(world)]
            assert len({len(s) for s in shares}) == 1  # equal shares: every rank joins each forward
            assert sorted(j for s in shares for j in s if j is not None) == list(range(n))


def test_two_nodes_train_checkpoint_die_and_resume_exactly(world):
    """docs/torchrun.md's two-node command, both nodes on this machine: SIGKILL after checkpoint 2, then both
    nodes resume; the rows equal a straight run's on one node of two ranks (the same arithmetic), bit for bit."""
    flags = ["--total-episodes", "512", "--save-every", "2", "--sample-every", "1"]
    straight = run(2, "test_shard_nodes_straight", *flags[2:], "--total-episodes", "512", "--micro-batch-size", "16")
    shutil.rmtree("runs/test_shard_nodes", ignore_errors=True)

    def nodes(*extra):
        port = free_port()
        return [subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "test_shard_nodes",
             "ppo.py", "--run-name", "test_shard_nodes", *FLAGS[2:], *flags,
             *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
            for _ in range(2)]

    first = nodes()
    deadline = time.time() + 300
    while not os.path.exists("runs/test_shard_nodes/checkpoints/step_2") and time.time() < deadline:
        assert all(p.poll() is None for p in first), "the run to be killed ended by itself"
        time.sleep(0.005)
    for p in first:
        kill_tree(p.pid)
        p.wait(timeout=60)
    assert not os.path.exists("runs/test_shard_nodes/policy")
    second = nodes("--resume", "auto")
    outs = [p.communicate(timeout=600) for p in second]
    assert all(p.returncode == 0 for p in second), outs[0][1][-2000:] + outs[1][1][-2000:]
    assert "checkpoints/step_" in outs[0][0]  # resumed, not restarted
    rows = [json.loads(line) for line in open("runs/test_shard_nodes/metrics.jsonl")]
    assert json.load(open("runs/test_shard_nodes/config.json"))["world_size"] == 2
    assert without_timings(rows) == without_timings(straight)


def refused(name, *flags):
    """A resume of test_shard_two's copy that must fail: its one-line error; the copy's files as they were."""
    before = {d: sorted(os.listdir(d)) for d in (f"runs/{name}/checkpoints/step_3", f"runs/{name}/checkpoints")}
    out = subprocess.run([sys.executable, "ppo.py", "--run-name", name, *FLAGS, *flags], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 2, out.stderr[-2000:]
    assert {d: sorted(os.listdir(d)) for d in before} == before
    return out.stderr.strip().splitlines()[-1]


def test_a_missing_shard_a_foreign_model_and_an_old_checkpoint_are_refused_in_one_line(saved):
    step = "runs/test_shard_refused/checkpoints/step_3"
    shutil.rmtree("runs/test_shard_refused", ignore_errors=True)
    shutil.copytree("runs/test_shard_two", "runs/test_shard_refused")
    os.remove(f"{step}/shards/__1_0.distcp")  # rank 1's shard
    assert refused("test_shard_refused", "--resume", step) == (
        f"error: --resume {step!r} is not a whole checkpoint (shards/__1_0.distcp is missing): "
        "pass runs/<run>/checkpoints/step_<k>")
    shutil.rmtree("runs/test_shard_refused")
    shutil.copytree("runs/test_shard_two", "runs/test_shard_refused")
    line = refused("test_shard_refused", "--resume", step, "--model", "chain")
    assert line.startswith(f"error: {step} was written with other flags (") and "--model 'toy' -> 'chain'" in line
    # a checkpoint of ppo.py before issue 55: the gathered policy/ and state.pt, no shards/
    sys.path.insert(0, ".")
    import ppo
    shutil.rmtree(f"{step}/shards")
    os.makedirs(f"{step}/policy")
    torch.save({"optimizers": [], "rngs": [{}, {}]}, f"{step}/state.pt")
    ppo.write_json(f"{step}/manifest.json", ppo.file_digests(step))
    line = refused("test_shard_refused", "--resume", "auto")
    assert line == (f"error: {step} is a gathered checkpoint of ppo.py before sharded ones (issue 55): resume it "
                    f"with that ppo.py (git log -- ppo.py), or start a new run from its weights: --model {step}/policy")


def test_a_model_folder_changed_under_a_checkpoint_is_refused_in_one_line(world, tmp_path):
    """The same --model path, other weights in it (the folder overwritten): the shards do not fit its shapes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = tmp_path / "policy"
    shutil.copytree(world[0], model)
    flags = ["--model", str(model), "--reward-model", world[1], "--total-episodes", "64", "--save-every", "1"]
    shutil.rmtree("runs/test_shard_foreign", ignore_errors=True)
    out = subprocess.run([sys.executable, "ppo.py", "--run-name", "test_shard_foreign", *flags], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    config = AutoModelForCausalLM.from_pretrained(model).config
    config.intermediate_size *= 2  # another MLP width
    AutoModelForCausalLM.from_config(config).save_pretrained(model)
    AutoTokenizer.from_pretrained(world[0]).save_pretrained(model)
    before = sorted(os.listdir("runs/test_shard_foreign/checkpoints/step_1/shards"))
    out = subprocess.run([sys.executable, "ppo.py", "--run-name", "test_shard_foreign", *flags, "--total-episodes",
                          "128", "--resume", "auto"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr[-2000:]
    assert "does not fit the models of these flags" in out.stderr, out.stderr
    assert sorted(os.listdir("runs/test_shard_foreign/checkpoints/step_1/shards")) == before


@pytest.mark.fast
@pytest.mark.parametrize("world_size", [2, 4])
def test_each_row_draws_and_trains_in_the_same_minibatch_on_any_number_of_ranks(monkeypatch, world_size):
    """The keys and minibatches of N ranks, put side by side, are one process's: the same rows, keys and sets."""
    import ppo
    args = ppo.Args(batch_size=64, num_minibatches=4, group_size=4, seed=3)

    def ranks(fn, world):
        out = []
        for rank in range(world):
            monkeypatch.setattr(ppo, "rank_and_world", lambda: (rank, world))
            out.append(fn(rank, 64 // world))
        return out
    for stream, group in ((0, 4), (1, 1), ((1, 2), 1)):
        one = ranks(lambda r, n: ppo.row_keys(args, 7, stream, r, n, group), 1)[0]
        assert sum(ranks(lambda r, n: ppo.row_keys(args, 7, stream, r, n, group), world_size), []) == one
        assert len(set(one)) == 64 // group  # a key per row (per group for the episodes' seeds)
    for epoch in range(3):  # minibatch k: slice k of each rank's order, as global rows
        def minibatches(world):
            orders = ranks(lambda r, n: (ppo.minibatch_order(args, 5, epoch, n) + r * n).tolist(), world)
            rows = 64 // world // 4
            return [sorted(sum((o[k * rows:(k + 1) * rows] for o in orders), [])) for k in range(4)]
        one = minibatches(1)
        assert minibatches(world_size) == one and sorted(sum(one, [])) == list(range(64))
        assert one != [list(range(k * 16, (k + 1) * 16)) for k in range(4)]  # shuffled, not the batch in order


@pytest.mark.fast
def test_the_minibatch_deal_changes_every_epoch_and_update_and_is_the_same_on_any_ranks(monkeypatch):
    """Issue 66: PPO's K epochs reshuffle the fixed batch into new minibatches. The 4 epochs of an update deal 64 rows
    into 4 minibatches in 4 different ways, the next update in others again, each the same on 1, 2 and 4 ranks."""
    import ppo
    args = ppo.Args(batch_size=64, num_minibatches=4, seed=3)

    def deal(update, epoch, world):  # the minibatches as sets of global rows, all ranks' slices put together
        minibatches = [set() for _ in range(4)]
        for rank in range(world):
            monkeypatch.setattr(ppo, "rank_and_world", lambda: (rank, world))
            order = (ppo.minibatch_order(args, update, epoch, 64 // world) + rank * (64 // world)).tolist()
            for k in range(4):
                minibatches[k] |= set(order[k * 16 // world:(k + 1) * 16 // world])
        return sorted(map(sorted, minibatches))
    deals = [deal(u, e, 1) for u in (1, 2) for e in range(4)]
    assert all(deal(u, e, w) == deals[(u - 1) * 4 + e] for u in (1, 2) for e in range(4) for w in (2, 4))
    assert len({str(d) for d in deals}) == 8  # (two deals of 64 rows alike by chance: ~1e-30)


@pytest.mark.fast
def test_no_two_random_streams_share_a_seed(world, monkeypatch):
    """Issue 62: every NumPy seed ppo.py draws from in a run (prompts, rows' keys, minibatches, PPO-ptx, the held-out
    split, evaluation) and in --dynamic-sampling's refills is a stream of its own: two different seeds never give
    the same generator state, and one state is never drawn by two streams. (NumPy seeds [s, u] and [s, u, 0] alike:
    untagged, minibatch_order's [s, u, 0] was row_keys' episode stream, and prompt pass u's generator its epoch 0.)"""
    import inspect
    import numpy as np
    import ppo
    from test_in_process import run_main
    seen, real_rng, real_seq = set(), np.random.default_rng, np.random.SeedSequence

    def recorded(real):
        def draw(seed=None, *a, **kw):
            caller = inspect.currentframe().f_back
            while caller.f_code.co_name.startswith("<"):  # (a comprehension's frame: its function's)
                caller = caller.f_back
            caller = caller.f_code
            if caller.co_filename == ppo.__file__ and seed is not None:  # (the libraries' own draws left out)
                seen.add((caller.co_name, tuple(int(x) for x in np.atleast_1d(seed))))
            return real(seed, *a, **kw)
        return draw
    monkeypatch.setattr(np.random, "default_rng", recorded(real_rng))
    monkeypatch.setattr(np.random, "SeedSequence", recorded(real_seq))
    run_main("test_streams", total_episodes=128, eval_every=1, ptx_coef=0.5, num_minibatches=2)
    args = ppo.Args(batch_size=64, group_size=4)
    for update, refill in ((1, 1), (1, 2), (2, 1)):
        ppo.refill_order(update, refill, np.arange(400), args, 0, 1)
    streams = {name for name, _ in seen}
    assert {"prompt_order", "row_keys", "minibatch_order", "ptx_loss", "refill_order"} <= streams, streams
    states = {}
    for name, seed in seen:
        states.setdefault(tuple(real_seq(seed).generate_state(4)), set()).add((name, seed))
    shared = [s for s in states.values() if len(s) > 1]
    assert not shared, shared


@pytest.mark.fast
def test_the_keyed_sampler_draws_from_hfs_distribution_and_a_row_only_from_its_key(world):
    """Over 4,000 keys the tokens drawn follow softmax(logits / T) after HF's own top-k and top-p filters (a
    chi-square bound), the log-probs kept are that filtered softmax's (the support --keep-sampling-mask scores, issue
    62); and a row draws the same tokens alone as in a batch."""
    import ppo
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]])  # (1, V)
    config = GenerationConfig(temperature=0.7, top_k=6, top_p=0.95, max_new_tokens=1)
    n = 4000
    sampler = ppo.KeyedSampler(range(n), config, torch.device("cpu"))
    chosen = sampler(None, logits.expand(n, -1)).argmax(1)  # (n,): the one-hot's token
    warped = TopPLogitsWarper(0.95)(None, TopKLogitsWarper(6)(None, logits / 0.7))
    p = torch.softmax(warped, -1)[0]  # (V,)
    counts = torch.bincount(chosen, minlength=8).float()
    assert (counts[p == 0] == 0).all()  # nothing outside HF's support
    expected = n * p[p > 0]
    chi2 = float(((counts[p > 0] - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, chi2  # the 0.999 quantile of chi-square with 4 degrees of freedom (5 tokens kept)
    kept = torch.log_softmax(warped, -1)[0, chosen]  # (n,)
    torch.testing.assert_close(sampler.logprobs()[:, 0], kept)
    tok = AutoTokenizer.from_pretrained(world[0], padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(world[0]).eval()
    policy.generation_config = GenerationConfig(do_sample=True, temperature=1.0, max_new_tokens=12,
                                                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    prompts = [tok(t).input_ids for t in ("the movie was", "a", "this film is very")]
    together = ppo.generate(policy, tok, prompts, torch.device("cpu"), keys=[11, 22, 33])
    alone = ppo.generate(policy, tok, prompts[2:], torch.device("cpu"), keys=[33])
    n2 = int(together[2][2])
    assert n2 > 1 and together[0][2, -together[2].max():][:n2].tolist() == alone[0][0, -alone[2].max():][:n2].tolist()
    others = [ppo.generate(policy, tok, prompts[2:], torch.device("cpu"), keys=[key])[0] for key in (34, 35, 36, 37)]
    assert any(o.tolist() != alone[0].tolist() for o in others)  # other keys, other tokens (one alike: ~0.5%)


@pytest.mark.fast
def test_the_keyed_sampler_gives_every_tail_token_of_a_real_vocabulary_its_width():
    """Issue 62: at Qwen2's V = 151,936, a token of probability 1e-9 late in the vocabulary lies where a float32
    running sum is near 1 (ulp 6e-8): its interval rounds to nothing and it is never drawn. Each such token must be
    drawn for a uniform in the middle of its exact interval; and the uniforms must resolve intervals that fine (a
    float32 uniform is a multiple of 2^-24)."""
    import ppo
    from transformers import GenerationConfig
    V = 151_936
    logits = 3 * torch.randn(1, V, generator=torch.Generator().manual_seed(0))  # (1, V)
    p = torch.softmax(logits.double(), -1)[0]  # (V,): the exact probabilities, to float64's rounding
    exact = p.cumsum(0)  # (V,): float64, each partial sum within V * 2^-53 = 1.7e-11 of exact
    tail = ((p > 1e-9) & (p < 1e-8) & (torch.arange(V) > V // 2)).nonzero().squeeze(1)[:64]  # (n,)
    assert len(tail) == 64  # (3 * N(0, 1) logits give thousands: widths 1e-9 >> 1.7e-11)
    sampler = ppo.KeyedSampler(range(len(tail)), GenerationConfig(temperature=1.0, max_new_tokens=1), "cpu")
    sampler.uniform = ((exact[tail] - p[tail] / 2) / exact[-1])[:, None]  # (n, 1): the middle of each interval
    drawn = sampler(None, logits.expand(len(tail), -1)).argmax(1)  # (n,)
    assert drawn.tolist() == tail.tolist()
    u = ppo.KeyedSampler([0], GenerationConfig(max_new_tokens=10_000), "cpu").uniform[0] * 2 ** 24  # (10000,)
    assert (u != u.floor()).float().mean() > 0.99  # off the float32 grid (a float64 uniform is on it w.p. 2^-29)
