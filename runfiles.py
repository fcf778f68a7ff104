"""ppo.py's run folder on disk, plumbing a reader of the algorithm never needs (docs/runs-that-die.md): writes that
a kill never leaves half done, one process per run folder, and what tells a whole checkpoint from a damaged one. A
cause that stops a run is a ValueError, which ppo.py prints in one line."""
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket


RUN_LOCKS = {}  # run folder -> its open lock file, held until the process ends


def lock_run(run_dir):
    """One process per run folder: a lock on runs/<run>/.lock, which the OS drops however the process ends."""
    os.makedirs(run_dir, exist_ok=True)
    if run_dir in RUN_LOCKS and os.path.exists(RUN_LOCKS[run_dir].name):
        return  # this process holds it already
    unlock_run(run_dir)  # (an earlier main in this process whose folder was deleted since)
    f = open(os.path.join(run_dir, ".lock"), "a+")
    try:
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        raise ValueError(f"{run_dir}/ is in use by another process ({f.read().strip() or 'unknown'}): wait for it to "
                         "end or stop it, or pick another --run-name")
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    RUN_LOCKS[run_dir] = f


def unlock_run(run_dir):
    lock = RUN_LOCKS.pop(run_dir, None)
    if lock is not None:
        lock.close()


def clear_leftovers(ckpt_root):
    """A killed save leaves step_<k>.tmp/ (never renamed into place) or .discard_* (renamed out, not yet gone)."""
    if os.path.isdir(ckpt_root):
        for d in os.listdir(ckpt_root):
            if d.endswith(".tmp") or d.startswith(".discard_"):
                shutil.rmtree(os.path.join(ckpt_root, d), ignore_errors=True)


def discard(path):
    """Delete a folder renamed out of the step_<k> pattern first: a kill never leaves half a checkpoint by its name."""
    trash = os.path.join(os.path.dirname(path), f".discard_{os.path.basename(path)}")
    shutil.rmtree(trash, ignore_errors=True)
    os.rename(path, trash)
    shutil.rmtree(trash)


def file_digests(folder, select=lambda rel: True):
    """{relative path: [bytes, sha256]} of the files under `folder` `select`ed, but the manifest itself."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in sorted(files):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder)
            if rel != "manifest.json" and select(rel):
                h = hashlib.sha256()
                with open(path, "rb") as f:
                    for block in iter(lambda: f.read(1 << 24), b""):
                        h.update(block)
                out[rel] = [os.path.getsize(path), h.hexdigest()]
    return out


def checkpoint_damage(path):
    """None for a whole checkpoint (every file of its manifest there, of its size and checksum), else what is wrong."""
    if not os.path.isdir(path):
        return "no such folder"
    try:
        manifest = json.load(open(os.path.join(path, "manifest.json")))
    except (OSError, ValueError) as e:
        return f"no readable manifest.json: {(str(e).strip().splitlines() or [type(e).__name__])[0]}"
    found = file_digests(path)
    for rel, (size, digest) in manifest.items():
        if rel not in found:
            return f"{rel} is missing"
        if found[rel] != [size, digest]:
            return f"{rel} is {'cut or padded' if found[rel][0] != size else 'corrupted (checksum differs)'}"
    return None


def list_checkpoints(ckpt_root):
    """Whole checkpoints (renamed into place), oldest first."""
    if not os.path.isdir(ckpt_root):
        return []
    steps = sorted(int(d[5:]) for d in os.listdir(ckpt_root) if re.fullmatch(r"step_\d+", d))
    return [os.path.join(ckpt_root, f"step_{k}") for k in steps]


def truncate_jsonl(path, last_step):
    """Drop the rows after the resumed checkpoint (none lost or doubled); written aside, then replacing the old file."""
    if os.path.exists(path):
        lines = open(path).read().splitlines(keepends=True)
        if lines and not lines[-1].endswith("\n"):
            lines.pop()  # a row cut short by the kill
        replace_file(path, "".join(line for line in lines if json.loads(line)["step"] <= last_step))


def write_json(path, obj):
    replace_file(path, json.dumps(obj, indent=2))


def replace_file(path, text):
    """Write aside, then replace: a reader sees the old file or the new one, never half of one."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def choose_checkpoint(flags, run_dir, log):
    """Rank 0: lock an existing run folder, clear what a killed save left, and pick the checkpoint to resume (None:
    a fresh run) for the run's flags (ppo.Args as a dict)."""
    if os.path.isdir(run_dir):
        lock_run(run_dir)
        clear_leftovers(os.path.join(run_dir, "checkpoints"))
    checkpoints = list_checkpoints(os.path.join(run_dir, "checkpoints"))
    if flags["resume"] is None:
        if checkpoints or os.path.exists(os.path.join(run_dir, "metrics.jsonl")) and any(
                line.strip() for line in open(os.path.join(run_dir, "metrics.jsonl"))):
            raise ValueError(f"{run_dir}/ already holds a run: continue it with --resume auto, or pick another "
                             "--run-name")
        return None
    if flags["resume"] == "auto":
        for path in reversed(checkpoints):  # newest first
            damage = checkpoint_damage(path)
            if damage is None:
                log(f"--resume auto: {path}")
                check_same_flags(flags, path)
                return path
            log(f"warning: {path} is damaged ({damage}); trying the checkpoint before it")
        if checkpoints:
            raise ValueError(f"no whole checkpoint in {run_dir}/checkpoints (all {len(checkpoints)} damaged): use a "
                             "new --run-name")
        log("--resume auto: no checkpoint yet, starting fresh")
        return None
    damage = checkpoint_damage(flags["resume"])
    if damage is not None:
        raise ValueError(f"--resume {flags['resume']!r} is not a whole checkpoint ({damage}): pass "
                         "runs/<run>/checkpoints/step_<k>")
    check_same_flags(flags, flags["resume"])
    return flags["resume"]


# flags that may differ when a run is resumed: how it is run, not what it computes (and --total-episodes)
RESUMABLE_CHANGES = {"total_episodes", "resume", "run_name", "exp_name", "debug", "track", "wandb_project",
                     "logprob_chunk", "micro_batch_tokens", "sample_every", "eval_every", "eval_greedy", "eval_samples",
                     "pass_threshold", "keep_best", "save_every", "keep_checkpoints", "max_nonfinite_steps",
                     "micro_batch_size", "gradient_checkpointing", "shard_frozen", "offload_frozen", "precision",
                     "sampler_precision", "pack", "vllm", "vllm_gpu_memory_utilization", "vllm_sleep",
                     "trust_remote_code"}


def check_same_flags(flags, ckpt):
    """Refuse to resume a checkpoint of ppo.py before sharded ones, or with flags that change what the run computes
    (each difference listed)."""
    if not os.path.isdir(os.path.join(ckpt, "shards")):
        raise ValueError(f"{ckpt} is a gathered checkpoint of ppo.py before sharded ones (issue 55): resume it with "
                         f"that ppo.py (git log -- ppo.py), or start a new run from its weights: --model {ckpt}/policy")
    saved = json.load(open(os.path.join(ckpt, "flags.json")))
    now = json.loads(json.dumps(flags))  # tuples as lists, as they were saved
    diffs = [f"--{k.replace('_', '-')} {saved.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(now) | set(saved))
             if k not in RESUMABLE_CHANGES and saved.get(k) != now.get(k)]  # (a flag gone since: --rollout-is-cap)
    if diffs:
        raise ValueError(f"{ckpt} was written with other flags ({'; '.join(diffs)}): resume with the run's own "
                         "flags (its config.json), or start a new --run-name")
