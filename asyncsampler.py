"""--async-steps' plumbing (docs/async.md): a second process that draws the next update's batch (phase 1) while ppo.py
trains on this one, reading the policy's weights from shared memory."""
import copy
import os
import queue
import signal
import time

import torch


class Sampler:
    """A second process draws update u+1's batch with the weights after update u-1 while update u trains (AReaL's
    one-step staleness). It reads the weights from shared memory: one copy, written only while it waits for a job,
    so it never sees half an update. Batches come back through a queue; `ready` is one drawn ahead (a checkpoint's).
    ppo.py's own `draw` (phase 1), `prompt_order` and `fail` come in as arguments."""
    def __init__(self, policy, tokenizer, args, device, ready, draw, prompt_order, fail):
        spawn = torch.multiprocessing.get_context("spawn")  # (a fork of a process whose OpenMP threads ran can hang)
        self.weights = copy.deepcopy(policy).share_memory()  # (not frozen: a frozen copy rounds otherwise)
        self.jobs, self.results, self.asked, self.ready, self.args, self.device, self.seconds = (
            spawn.Queue(), spawn.Queue(), None, ready, args, device, 0.0)
        self.prompt_order, self.fail = prompt_order, fail
        self.cores = cores = torch.get_num_threads()  # on a CPU the cores are split: half each (until close)
        torch.set_num_threads(max(1, cores - cores // 2))
        self.process = spawn.Process(target=sampler_process, daemon=True, args=(
            draw, self.weights, tokenizer, args, device, max(1, cores // 2), os.getpid(), self.jobs, self.results))
        stops = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}  # ignored from
        self.process.start()  # its first instruction (inherited): the trainer stops the run; the sampler ends after
        for sig, handler in stops.items():
            signal.signal(sig, handler)

    def ask(self, update, policy, prompt_ids):
        with torch.no_grad():  # the sampler waits for a job now: the copy is whole before it reads
            for mine, new in zip(self.weights.parameters(), policy.parameters()):
                mine.copy_(new)
        if self.device.type == "cuda":  # (the copies done before another process reads them)
            torch.cuda.synchronize(self.device)
        self.jobs.put((update, prompt_ids))
        self.asked = update

    def wait(self):
        """The batch in flight, once drawn: (update, `generate`'s tensors on the CPU), or None when none is."""
        while self.asked is not None:
            try:
                update, drawn, self.seconds = self.results.get(timeout=1)
            except queue.Empty:
                if not self.process.is_alive():
                    self.fail(f"the sampler process died (exit code {self.process.exitcode}) drawing update "
                         f"{self.asked}'s batch; nothing written is lost: --resume auto continues from the newest "
                         "checkpoint, if there is one")
                continue
            if isinstance(drawn, str):
                self.fail(f"the sampler process failed drawing update {update}'s batch: {drawn}")
            self.ready, self.asked = (update, drawn), None
        return self.ready

    def take(self, update, policy, prompt_ids, last):
        """Update `update`'s batch on the trainer's device; then the next is asked of the weights now in `policy`."""
        args, order = self.args, self.prompt_order  # (one process: rank 0, the whole batch)
        prompts_of = lambda u: [prompt_ids[i] for i in order(u, len(prompt_ids), args, 0, args.batch_size)]  # noqa
        if self.ready is None and self.asked is None:  # a run's first update: drawn now, by the first weights
            self.ask(update, policy, prompts_of(update))
        (drawn_update, drawn), self.ready = self.wait(), None
        if drawn_update != update:  # (a bug, not bad input; not an assert, which python -O drops)
            raise RuntimeError(f"update {update} was given the batch of update {drawn_update}")
        if not last:
            self.ask(update + 1, policy, prompts_of(update + 1))
        return [x.to(self.device) if torch.is_tensor(x) else x for x in drawn]

    def close(self):
        self.jobs.put(None)  # (it ends by itself too, within a second of this process)
        torch.set_num_threads(self.cores)


def sampler_process(draw, policy, tokenizer, args, device, threads, trainer, jobs, results):
    """The sampler's loop: phase 1 for each (update, prompt ids) asked, on a random stream keyed by (seed, update)."""
    torch.set_num_threads(threads)
    while os.getppid() == trainer:  # (a trainer killed by SIGKILL leaves no orphan)
        try:
            job = jobs.get(timeout=1)
        except queue.Empty:
            continue
        if job is None:
            return
        t0 = time.perf_counter()
        try:
            drawn = draw(policy, tokenizer, job[1], args, job[0], device)
            results.put((job[0], [x.cpu() if torch.is_tensor(x) else x for x in drawn], time.perf_counter() - t0))
        except Exception as e:  # (sent back: the trainer names it in one line)
            results.put((job[0], f"{type(e).__name__}: {e}", 0.0))
