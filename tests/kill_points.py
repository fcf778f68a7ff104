"""SIGKILL at every file-system step of checkpoint writing, pruning and the resume's rewrite, then resume.

    python tests/kill_points.py        # one checkpoint with pruning (steps inside its temporary and discarded
                                       # folders left out), and one resume: about 2 minutes
    python tests/kill_points.py --all  # every file-system step of a whole run, then of one resume
    python tests/kill_points.py --fp16 # the same in fp16, its loss scale forced to move (it must be restored too)
    python tests/kill_points.py --async-steps  # the same at --async-steps 1: the batch drawn ahead is saved too

A reference run (6 updates of 16, a checkpoint every 2, keep 2) records every file-system call it
makes: opening a file to write, fsync, rename and replace, deleting a tree, making a folder, torch.save
and the safetensors writer. Then, for each chosen step k, a child process runs the same command and
SIGKILLs itself just before step k, or just after it; a second child continues with --resume auto; the rows of
metrics.jsonl and samples.jsonl must equal the reference's bit for bit (all but time/ and mem/ keys),
none lost and none doubled. The resume's own rewrite (lock, leftovers, the kept rows written aside
and swapped in, config.json) gets the same treatment: a run cut after its checkpoint at 4 with rows
1-6 written, resumed with a kill at each step, then resumed again.

Children are forked from this process, which imports torch but never computes (OpenMP is not
fork-safe once its threads exist), so a trial costs a second or two, not an interpreter start.
Prints one JSON line: the kill points tried and the ones that failed.
"""
import builtins
import json
import os
import re
import shutil
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.chdir(ROOT)
import torch  # noqa: E402
import transformers.modeling_utils  # noqa: E402

import ppo  # noqa: E402

FLAGS = dict(total_episodes=96, batch_size=16, response_length=8, num_ppo_epochs=1, save_every=2,
             keep_checkpoints=2, sample_every=1)
KEEP_OUT = ("time/", "mem/")


def hook_file_system(kill_at, log):
    """Count every file-system step; SIGKILL this process at step kill_at = (k, "before" or "after")."""
    count = [0]

    def step(kind, path):
        count[0] += 1
        if log is not None:
            log.append([kind, str(path)])
        if (count[0], "before") == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return (count[0], "after") == kill_at

    def wrap(owner, name, kind, writes=None, path=0):  # path: the argument that names the file
        real = getattr(owner, name)

        def hooked(*a, **kw):
            named = a[path] if len(a) > path else kw.get("f", "?")
            kill_after = (writes is None or writes(*a, **kw)) and step(kind, named)
            out = real(*a, **kw)
            if kill_after:  # e.g. a file just opened for writing, and so emptied, before a byte is written
                os.kill(os.getpid(), signal.SIGKILL)
            return out
        setattr(owner, name, hooked)

    def opens_to_write(file, mode="r", *a, **kw):
        return any(c in mode for c in "wax+") and not isinstance(file, int)
    wrap(builtins, "open", "open", opens_to_write)
    for name in ("replace", "rename", "fsync", "makedirs", "unlink", "rmdir"):  # unlink, rmdir: inside rmtree
        wrap(os, name, name)
    wrap(shutil, "rmtree", "rmtree")
    # (torch.distributed.checkpoint's writer torch.saves each tensor into a stream of a file it opened: not a step)
    wrap(torch, "save", "torch.save", lambda obj, f, *a, **kw: isinstance(f, (str, os.PathLike)), path=1)
    real_save_file = transformers.modeling_utils.safe_save_file

    def save_file(tensors, filename, *a, **kw):
        kill_after = step("safetensors", filename)
        real_save_file(tensors, filename, *a, **kw)
        if kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    transformers.modeling_utils.safe_save_file = save_file


def child(run_name, kill_at=None, log_path=None, **flags):
    """Fork: run ppo.main in the child (killed at a step, or to the end); the parent waits. Returns the status."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            log = [] if log_path else None
            hook_file_system(kill_at, log)
            sys.stdout = sys.stderr = open(os.devnull, "w")
            ppo.main(ppo.Args(run_name=run_name, **dict(FLAGS, **flags)))
            if log_path:
                with open(log_path, "w") as f:
                    json.dump(log, f)
        except BaseException:
            code = 1
        os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def rows(run, name):
    path = f"runs/{run}/{name}"
    if not os.path.exists(path):
        return []
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(KEEP_OUT)} for line in open(path)]


def same_as(run, ref):
    return all(rows(run, f) == rows(ref, f) for f in ("metrics.jsonl", "samples.jsonl"))


def main():
    import toy
    toy.build_world()
    sweep_all, tag = "--all" in sys.argv, "_fp16" if "--fp16" in sys.argv else ""
    if "--async-steps" in sys.argv:  # (each run starts a sampler process: a few seconds more a trial)
        FLAGS["async_steps"], tag = 1, tag + "_async"
    if tag:  # a loss scale of 2^30 overflows the first steps: the scale moves within the run, as a resume must see
        FLAGS["precision"], real = "fp16", torch.amp.GradScaler
        torch.amp.GradScaler = lambda device: real(device, init_scale=2.0 ** 30)
    ref, log_path = f"kill{tag}_ref", f"runs/kill{tag}_ref_ops.json"
    shutil.rmtree(f"runs/{ref}", ignore_errors=True)
    assert child(ref, log_path=log_path) == 0, "the reference run failed"
    ops = json.load(open(log_path))[:-1]  # the last is the child writing this very log, after ppo.main
    if sweep_all:
        chosen = range(1, len(ops) + 1)
    else:  # the checkpoint of update 6, which also prunes step_2; a step on a file inside the temporary
        # or the discarded folder leaves the same state as its neighbours (nothing reads those folders): skipped
        first = next(i for i, (_, path) in enumerate(ops, 1) if "step_6" in path)
        last = max(i for i, (_, path) in enumerate(ops, 1) if "checkpoints" in path)
        chosen = [i for i in range(first, last + 1) if not re.search(r"(\.tmp|\.discard_step_\d+)/", ops[i - 1][1])]
    tried, failed = 0, []
    for k in chosen:
        for when in ("before", "after"):
            run = f"kill{tag}_trial"
            shutil.rmtree(f"runs/{run}", ignore_errors=True)
            killed = child(run, kill_at=(k, when))
            resumed = child(run, resume="auto")
            tried += 1
            if killed != -signal.SIGKILL or resumed != 0 or not same_as(run, ref):
                failed.append(dict(step=k, when=when, op=ops[k - 1], killed=killed, resumed=resumed))

    # the resume's rewrite: rows 1-6 on disk, the newest checkpoint at 4
    cut = f"kill{tag}_cut"
    shutil.rmtree(f"runs/{cut}", ignore_errors=True)
    shutil.copytree(f"runs/{ref}", f"runs/{cut}")
    for name in ("checkpoints/step_6", "policy", "critic"):
        shutil.rmtree(f"runs/{cut}/{name}")
    resume_log = f"runs/kill{tag}_resume_ops.json"
    shutil.rmtree(f"runs/{cut}_probe", ignore_errors=True)
    shutil.copytree(f"runs/{cut}", f"runs/{cut}_probe")
    assert child(f"{cut}_probe", resume="auto", log_path=resume_log) == 0, "the probe resume failed"
    resume_ops = json.load(open(resume_log))
    first_update = next(i for i, (kind, path) in enumerate(resume_ops, 1) if path.endswith("samples.jsonl"))
    for k in range(1, first_update + 1):
        for when in ("before", "after"):
            run = f"kill{tag}_resume_trial"
            shutil.rmtree(f"runs/{run}", ignore_errors=True)
            shutil.copytree(f"runs/{cut}", f"runs/{run}")
            killed = child(run, kill_at=(k, when), resume="auto")
            resumed = child(run, resume="auto")
            tried += 1
            if killed != -signal.SIGKILL or resumed != 0 or not same_as(run, ref):
                failed.append(dict(resume_step=k, when=when, op=resume_ops[k - 1], killed=killed, resumed=resumed))
    for run in (ref, cut, f"{cut}_probe", f"kill{tag}_trial", f"kill{tag}_resume_trial"):
        if not failed:
            shutil.rmtree(f"runs/{run}", ignore_errors=True)
    print(json.dumps(dict(kill_points=tried, run_ops=len(ops), resume_ops=first_update, failed=failed)))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
