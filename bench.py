"""How fast is ppo.py, how far above the bare model work, and (optionally) next to TRL's PPOTrainer.

    python bench.py                                   # the toy world: batch 64, 32 tokens, 4 epochs, 6 updates
    python bench.py --rounds 2 --kl-coef 0.1          # flags bench.py does not know go to ppo.py as they are
    python bench.py --model runs/smollm2/model --reward-fn smollm2.py:reward \\
        --dataset runs/smollm2/sums.jsonl --batch-size 8 --response-length 24 --micro-batch-size 4  # any checkpoint
    python bench.py --rounds 2 --trl-python PATH/TO/trl-env/bin/python \\
        --trl-script PATH/TO/trl_ppo_baseline.py      # ours, TRL, ours, TRL at the same settings

Ours: ppo.py runs in a subprocess under a fresh run name (its run folder is deleted afterwards) and
bench.py reads the phase timings it logs in metrics.jsonl. Seconds per update are the sum of the
timed phases (rollout + PPO epochs + weight push + logging; the few print and file-write calls
between them are not timed), median over every update but the first of each run (warm-up).
Phases: generation (HF generate, EOS cut, decode), the no-grad scoring passes (policy, reference,
critic and reward model forwards, the reward function, plus rewards, GAE and whitening), the PPO
epochs, the weight push (with --vllm only; on the HF path generation reads the trained weights,
there is nothing to push and the row says n.a.) and logging. Peak memory is ppo.py's `mem/peak_mb`:
the process's peak RSS on CPU, peak allocated bytes on GPU.

The floor: the model work no PPO trainer can skip, at the same shapes, in this process, on the same
checkpoints and prompts: every flag (bench.py's and the ones passed through) is parsed into ppo.py's
own Args, the models are loaded by ppo.py's `load_models` and the prompts drawn by its `prompt_order`:
  - one `generate` of the batch (the same temperature, top-k and top-p, stopping at the run's stop
    ids) and its decoding: the responses vary in length, so every pass below reuses them;
  - the no-grad passes, in the run's micro-batches: policy and reference log-probs (through the same
    head, chunked or plain, as --logprob-chunk says), critic values,
    and the score (reward-model forward and/or the reward function, through ppo.py's `score`);
  - K epochs x minibatches of actor and critic forward+backward (in micro-batches) and
    `optimizer_step` (gradient clipping and AdamW, learning rate 0 so the sampler stays the checkpoint's).
Not in the floor: entropies, KL rewards, GAE, whitening, the PPO loss terms and their statistics,
the health check and logging: the trainer's overhead is all of that plus any waste, and is reported
as trainer seconds per update / floor seconds per update - 1. The floor always generates with HF
`generate` and keeps every model on the device, so with --vllm or --offload-frozen the ratio
compares different work.

Output: one table, then one JSON line with the same figures (last line of stdout).

The scaling table (`--scaling`): random-init Llama policies and reward models at several vocabularies
(8K: a character-level tokenizer; 32K: Llama 2's; 152K: Qwen2's, both from tests/tokenizers), response
lengths and body sizes (1M / 10M / 40M parameters without the embeddings and the head), built under
runs/bench_scaling/. Random weights almost never sample an EOS, so every response is as long as the
limit, for both trainers. At each point, one process each, in turn: ppo.py, ppo.py with
--logprob-chunk 0 (the plain head, as ppo.py was before the chunked one), TRL, then the floor;
wall and CPU seconds per update (medians after the warm-up) and peak RSS. With --rounds N the four
run N times in that order and the medians pool them. Each point's row goes into
experiments/scaling.json as it is measured, replacing that point's row with the same extra flags
(e.g. --vllm), and the table printed at the end is the whole file.

    python bench.py --scaling --trl-python PATH/TO/trl-env/bin/python --trl-script PATH/TO/trl_ppo_baseline.py

Responses of spread lengths (`--spread`): one batch of 32 responses of 8 to 256 tokens through the
rollout passes and 2 epochs, --micro-batch-size 4 against --micro-batch-tokens of the same largest
micro-batch (4 x (prompt + 256) padded tokens), CPU seconds.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace
from dataclasses import dataclass
from statistics import median
from typing import Optional

import torch
import transformers
import tyro
from transformers import GenerationConfig

import ppo


@dataclass
class Args:
    updates: int = 6
    """PPO updates per trainer run (and floor repeats); the first is a warm-up and not counted"""
    model: str = "toy"
    """policy checkpoint (ppo.py's --model; `toy` = the built-in world)"""
    reward_model: Optional[str] = None
    """reward model (ppo.py's --reward-model; the toy world's own by default)"""
    reward_fn: Optional[str] = None
    """a Python reward (ppo.py's --reward-fn)"""
    dataset: Optional[str] = None
    """prompts (ppo.py's --dataset; the toy world's by default)"""
    batch_size: int = 64
    """rollouts per update"""
    response_length: int = 32
    """the most tokens generated per response"""
    num_ppo_epochs: int = 4
    """K, passes over each rollout batch"""
    num_minibatches: int = 1
    """optimizer steps per epoch"""
    temperature: float = 0.7
    """sampling temperature (ppo.py's default; TRL's baseline uses 0.7 too)"""
    rounds: int = 1
    """runs of each trainer, alternated (ours, TRL, ours, TRL...); the figures pool all of them"""
    seed: int = 1
    """seed of ppo.py and of the floor's sampler"""
    trl_python: Optional[str] = None
    """the python of an environment with TRL (None = skip TRL)"""
    trl_script: Optional[str] = None
    """TRL baseline script (shared/bench/trl_ppo_baseline.py); needed with --trl-python"""
    scaling: bool = False
    """the scaling table instead: --points of (vocabulary, response length, body size), batch --batch-size"""
    spread: bool = False
    """instead: --micro-batch-tokens against --micro-batch-size on one batch of responses of 8 to 256 tokens"""
    points: tuple[str, ...] = ("8k,256,10M", "32k,256,10M", "152k,256,10M", "152k,64,10M", "152k,1024,10M",
                               "32k,256,1M", "32k,256,40M")
    """scaling points: the three axes through (152k, 256, 10M), the size axis at 32k"""


def trainer_flags(args, extra):
    """ppo.py's command-line flags for this benchmark: bench.py's own, then the ones passed through."""
    flags = ["--model", args.model, "--seed", str(args.seed), "--total-episodes", str(args.updates * args.batch_size),
             "--batch-size", str(args.batch_size), "--response-length", str(args.response_length),
             "--num-ppo-epochs", str(args.num_ppo_epochs), "--num-minibatches", str(args.num_minibatches),
             "--temperature", str(args.temperature), "--save-every", "0", "--sample-every", "0"]
    for flag, value in (("--reward-model", args.reward_model), ("--reward-fn", args.reward_fn),
                        ("--dataset", args.dataset)):
        if value is not None:
            flags += [flag, value]
    return flags + list(extra)


def run_ours(flags, name):
    """ppo.py in a subprocess; its metric rows after the warm-up update."""
    run_dir = os.path.join("runs", name)
    shutil.rmtree(run_dir, ignore_errors=True)  # ppo.py refuses a run folder that already holds metrics
    cmd = [sys.executable, "ppo.py", "--run-name", name, *flags]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"ppo.py failed ({' '.join(cmd)}):\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    shutil.rmtree(run_dir)
    return rows[1:]


def run_trl(args, policy_path, reward_path, prompts_file, workdir):
    """TRL's PPOTrainer through the baseline script; its RESULT dict (median_update_s, peak_rss_mb)."""
    cmd = [args.trl_python, os.path.abspath(args.trl_script), "--policy", os.path.abspath(policy_path),
           "--reward", os.path.abspath(reward_path), "--prompts", prompts_file, "--batch", str(args.batch_size),
           "--response-length", str(args.response_length), "--ppo-epochs", str(args.num_ppo_epochs),
           "--mini-batches", str(args.num_minibatches), "--temperature", str(args.temperature),
           "--updates", str(args.updates), "--stop-at-eos", "--out", os.path.join(workdir, "trl_out")]
    out = subprocess.run([cmd[0], "-c", TRL_WITH_CPU, *cmd[1:]], capture_output=True, text=True, cwd=workdir)
    results = [line[len("RESULT "):] for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not results:
        return {"failed": (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]}
    cpu = [line[len("CPU "):] for line in out.stdout.splitlines() if line.startswith("CPU ")]
    rss = json.loads([line[len("RSS "):] for line in out.stdout.splitlines() if line.startswith("RSS ")][-1])
    res = {**json.loads(results[-1]), "median_cpu_s": json.loads(cpu[-1])}
    return {**res, "peak_rss_mb": rss} if rss else res


# TRL's baseline, its step timer also reading this process's CPU seconds (the script times wall clock only)
TRL_WITH_CPU = """
import json, runpy, statistics, sys, time
sys.argv = sys.argv[1:]
base = runpy.run_path(sys.argv[0], run_name="baseline")
timers, init, end = [], base["StepTimer"].__init__, base["StepTimer"].on_step_end
def init_cpu(self):
    init(self); self.cpu, self.c = [], time.process_time(); timers.append(self)
def end_cpu(self, *a, **k):
    end(self, *a, **k); now = time.process_time(); self.cpu.append(now - self.c); self.c = now
base["StepTimer"].__init__, base["StepTimer"].on_step_end = init_cpu, end_cpu
base["main"]()
print("CPU", json.dumps(statistics.median(timers[0].cpu[1:] or timers[0].cpu)))
hwm = [int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")]
print("RSS", json.dumps(hwm[0] / 1024 if hwm else None))  # ru_maxrss would include the parent's (kept over exec)
"""


def measure_floor(pargs, updates):
    """Seconds of the bare model work per update (generation, no-grad passes, PPO epochs), warm-up dropped."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    quiet = lambda *a, **k: None  # noqa: E731
    ppo.check_args(pargs, 1)  # the defaults a run fills in from other flags (reasoning-gym:NAME's reward, ...)
    models = ppo.load_models(pargs, device, quiet)
    tokenizer, policy, critic = models.tokenizer, models.policy, models.critic
    models.ref_policy.to(device)  # the floor keeps every model on the device
    if models.reward_model is not None:
        models.reward_model.to(device)
    policy.generation_config = GenerationConfig(  # as in ppo.main
        do_sample=True, temperature=pargs.temperature, top_p=pargs.top_p, top_k=pargs.top_k,
        max_new_tokens=pargs.response_length, eos_token_id=models.stop_ids, pad_token_id=tokenizer.pad_token_id)
    prompt_rows, prompt_ids = ppo.load_prompts(pargs, tokenizer, quiet)[:2]
    trained = [m for m in (policy, critic) if m is not None]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.0, eps=1e-5) for m in trained]
    mb_rows = pargs.batch_size // pargs.num_minibatches
    micro = pargs.micro_batch_size or mb_rows
    ppo.seed_everything(pargs.seed)
    times = []
    for update in range(1, updates + 1):
        batch_idx = ppo.prompt_order(update, len(prompt_rows), pargs, 0, pargs.batch_size)  # (B,)
        sync()
        t0, cpu0 = time.perf_counter(), time.process_time()
        qr, am, lengths, has_eos, mask, P = ppo.generate(policy, tokenizer, [prompt_ids[i] for i in batch_idx],
                                                         device)[:6]
        texts = tokenizer.batch_decode([r[: int(n)] for r, n in zip(qr[:, P:], lengths)], skip_special_tokens=True)
        sync()
        t1 = time.perf_counter()
        with torch.no_grad():
            for i in range(0, len(qr), micro):
                rows = slice(i, i + micro)
                t = int(lengths[rows].max())
                mb_qr, mb_am = qr[rows, :P + t], am[rows, :P + t]  # (b, P+t)
                ppo.policy_logprobs(policy, mb_qr, mb_am, P, pargs.temperature, chunk=pargs.logprob_chunk)
                ppo.policy_logprobs(models.ref_policy, mb_qr, mb_am, P, pargs.temperature, chunk=pargs.logprob_chunk)
                if critic is not None:
                    ppo.state_values(critic, mb_qr, mb_am, P)
            ppo.score(models, pargs, [prompt_rows[i] for i in batch_idx], texts, qr, am, lengths, P, micro)
        sync()
        t2 = time.perf_counter()
        for model in trained:
            model.train(False)  # as the trainer without gradient checkpointing; dropout is off anyway
        for epoch in range(pargs.num_ppo_epochs):
            perm = torch.randperm(len(qr), device=device)  # (B,)
            for start in range(0, len(qr), mb_rows):
                mb_idx = perm[start: start + mb_rows]  # (b,)
                n_tokens = mask[mb_idx].sum()
                for i in range(0, len(mb_idx), micro):
                    idx = mb_idx[i: i + micro]
                    t = int(lengths[idx].max())  # trimmed to the longest response, as in the trainer
                    mb_qr, mb_am, mb_mask = qr[idx, :P + t], am[idx, :P + t], mask[idx, :t]  # (b, P+t), (b, t)
                    logprobs = ppo.policy_logprobs(policy, mb_qr, mb_am, P, pargs.temperature,
                                                   chunk=pargs.logprob_chunk)[0]  # (b, t)
                    loss = (logprobs * mb_mask).sum()
                    if critic is not None:
                        loss = loss + (ppo.state_values(critic, mb_qr, mb_am, P)[:, :t] * mb_mask).sum()
                    (loss / n_tokens).backward()
                ppo.optimizer_step(trained, optimizers, 1.0)
        sync()
        t3 = time.perf_counter()
        times.append({"generate_s": t1 - t0, "score_s": t2 - t1, "ppo_epochs_s": t3 - t2, "update_s": t3 - t0,
                      "cpu_s": time.process_time() - cpu0})
    return times[1:]


def main(args, extra):
    os.chdir(os.path.dirname(os.path.abspath(__file__)))  # ppo.py reads and writes runs/ from the repository root
    if (args.trl_python is None) != (args.trl_script is None):
        sys.exit("--trl-python and --trl-script go together")
    if args.updates < 2:
        sys.exit("--updates must be at least 2: the first update is a warm-up")
    transformers.utils.logging.disable_progress_bar()  # no loading bars or load reports before the table
    transformers.utils.logging.set_verbosity_error()
    flags = trainer_flags(args, extra)
    pargs = tyro.cli(ppo.Args, args=flags)  # the trainer's own reading of the flags, for the floor
    policy_path, reward_path = args.model, args.reward_model
    if args.model == "toy":
        import toy
        policy_path, toy_reward = toy.build_world()  # cached; built once before the first run so no run times it
        reward_path = reward_path or (None if args.reward_fn else toy_reward)
    workdir = tempfile.mkdtemp(prefix="bench_")
    prompts_file = None
    if args.trl_python:
        if reward_path is None or args.reward_fn:
            sys.exit("--trl-python needs a reward model and no --reward-fn: TRL's PPOTrainer scores with a model")
        prompt_rows = ppo.load_prompt_rows(pargs)[0]
        if not all(isinstance(r["prompt"], str) for r in prompt_rows):
            sys.exit("--trl-python needs text prompts: the TRL baseline script applies no chat template")
        prompts_file = os.path.join(workdir, "prompts.jsonl")
        with open(prompts_file, "w") as f:
            f.writelines(json.dumps({"prompt": r["prompt"]}) + "\n" for r in prompt_rows)

    rows, trl, floor = [], [], []
    for r in range(args.rounds):  # alternate, so that a slow spell of a shared machine hits both trainers
        rows += run_ours(flags, f"bench_{os.getpid()}_{r}")
        if args.trl_python:
            trl.append(run_trl(args, policy_path, reward_path, prompts_file, workdir))
            if "failed" in trl[-1]:
                sys.exit(f"the TRL baseline failed: {trl[-1]['failed']}")
        floor += measure_floor(pargs, args.updates)
    shutil.rmtree(workdir)

    col = lambda key: [row.get(key, 0.0) for row in rows]  # noqa: E731
    totals = [row["time/rollout_s"] + row["time/update_s"] + row.get("time/push_s", 0.0) + row["time/log_s"]
              for row in rows]
    res = {
        "update_s": median(totals),
        "generate_s": median(col("time/generate_s")),
        "score_s": median([row["time/rollout_s"] - row["time/generate_s"] for row in rows]),
        "ppo_epochs_s": median(col("time/update_s")),
        "push_s": median(col("time/push_s")),
        "log_s": median(col("time/log_s")),
        "generated_tokens_per_s": sum(col("time/generated_tokens")) / sum(col("time/generate_s")),
        "trained_tokens_per_s": sum(col("time/trained_tokens")) / sum(col("time/update_s")),
        "peak_mem_mb": max(col("mem/peak_mb")),
        **{f"floor_{k}": median([f[k] for f in floor]) for k in ("update_s", "generate_s", "score_s", "ppo_epochs_s")},
    }
    res["overhead_above_floor"] = res["update_s"] / res["floor_update_s"] - 1
    if trl:
        res["trl_update_s"] = median([t["median_update_s"] for t in trl])
        res["trl_peak_rss_mb"] = max(t["peak_rss_mb"] for t in trl)
        res["ratio_update_s"] = res["update_s"] / res["trl_update_s"]
        res["ratio_peak_mem"] = res["peak_mem_mb"] / res["trl_peak_rss_mb"]

    push = "--vllm" in extra  # HF generate shares the trained weights: nothing to push
    print(f"\n{args.model}: batch {args.batch_size}, response length {args.response_length}, "
          f"{args.num_ppo_epochs} epochs x "
          f"{args.num_minibatches} minibatch(es); medians of {len(rows)} updates in {args.rounds} run(s), "
          f"device {'cuda' if torch.cuda.is_available() else 'cpu'}")
    print(f"| {'phase':<35} | {'ppo.py s':>10} | {'floor s':>10} |\n|{'-' * 37}|{'-' * 11}:|{'-' * 11}:|")
    for name, key, fkey in (("generation", "generate_s", "floor_generate_s"),
                            ("no-grad scoring passes (+ GAE)", "score_s", "floor_score_s"),
                            ("PPO epochs", "ppo_epochs_s", "floor_ppo_epochs_s"),
                            ("weight push" + ("" if push else " (n.a. with HF generate)"), "push_s", None),
                            ("logging", "log_s", None),
                            ("total per update", "update_s", "floor_update_s")):
        floor_cell = f"{res[fkey]:.4f}" if fkey else "-"
        print(f"| {name:<35} | {res[key]:>10.4f} | {floor_cell:>10} |")
    print(f"overhead above the floor: {res['overhead_above_floor']:+.1%}")
    print(f"generated tokens/s {res['generated_tokens_per_s']:.0f}, "
          f"trained tokens/s {res['trained_tokens_per_s']:.0f}, peak memory {res['peak_mem_mb']:.0f} MB")
    if trl:
        print(f"TRL: {res['trl_update_s']:.3f} s/update (ours x{res['ratio_update_s']:.3f}), "
              f"peak RSS {res['trl_peak_rss_mb']:.0f} MB (ours x{res['ratio_peak_mem']:.3f})")
    print(json.dumps({k: round(v, 5) for k, v in res.items()}))


# --- the scaling table ------------------------------------------------------------------------

BODIES = {"1M": (128, 4, 384, 4), "10M": (256, 12, 768, 4), "40M": (512, 12, 1536, 8)}  # hidden, layers, mlp, heads
VOCABS = {"8k": None, "32k": "llama", "152k": "qwen2"}  # tokenizer: a character-level one of 8,192, or a real one


def scaling_checkpoint(vocab, body):
    """runs/bench_scaling/<vocab>_<body>/{policy,reward}: random-init Llama models and their tokenizer."""
    from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                              LlamaConfig, PreTrainedTokenizerFast)
    out = os.path.join("runs", "bench_scaling", f"{vocab}_{body}")
    if os.path.exists(os.path.join(out, "reward", "config.json")):
        return os.path.join(out, "policy"), os.path.join(out, "reward")
    if VOCABS[vocab] is None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        words = ["<pad>", "<eos>", "<unk>"] + [chr(c) for c in range(32, 127)]
        words += [f"<extra_{i}>" for i in range(8192 - len(words))]
        tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.Split("", behavior="isolated"), decoders.Fuse()
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                            unk_token="<unk>")
    else:
        sys.path.insert(0, "tests")
        from real_models import tokenizer_dir
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(VOCABS[vocab]))
        tokenizer.chat_template = None  # raw text prompts, as the TRL baseline script feeds them
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.unk_token
    hidden, layers, mlp, heads = BODIES[body]
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                         intermediate_size=mlp, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=2048, tie_word_embeddings=False, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    for name, cls in (("policy", AutoModelForCausalLM), ("reward", AutoModelForSequenceClassification)):
        cls.from_config(config).save_pretrained(os.path.join(out, name))
        tokenizer.save_pretrained(os.path.join(out, name))
    return os.path.join(out, "policy"), os.path.join(out, "reward")


def scaling(args, extra):
    """One row per point: ppo.py, the plain head, TRL and the floor, each timed at the same shapes. Each row
    goes into experiments/scaling.json as it is measured, replacing that point's old row (with the same
    extra flags), and the table printed at the end is the file's: a few points can be measured again."""
    table = []
    for point in args.points:
        vocab, length, body = point.split(",")
        policy, reward = scaling_checkpoint(vocab, body)
        prompts = os.path.join("runs", "bench_scaling", "prompts.jsonl")
        g = torch.Generator().manual_seed(0)  # random lower-case words, 4-16 characters, as the TRL script's own
        with open(prompts, "w") as f:
            for n in torch.randint(4, 17, (256,), generator=g).tolist():
                f.write(json.dumps({"prompt": "".join(chr(97 + c) for c in torch.randint(0, 26, (n,), generator=g)
                                                      .tolist())}) + "\n")
        a = Args(**{**vars(args), "model": policy, "reward_model": reward, "dataset": prompts,
                    "response_length": int(length), "scaling": False})
        flags = trainer_flags(a, ["--critic-init", "reward", "--missing-eos-penalty", "None", *extra])
        row = {"point": point, "vocab": vocab, "length": int(length), "body": body, "flags": " ".join(extra),
               "date": time.strftime("%Y-%m-%d")}
        wall, cpu, rss = {}, {}, {}  # per trainer: every counted update of every round; the peak
        for _ in range(args.rounds):  # ppo.py, its plain head, TRL, the floor, in turn, so drifts hit all four
            for name, more in (("ours", []), ("plain", ["--logprob-chunk", "0"])):
                rows = run_ours(flags + more, f"bench_{os.getpid()}_{name}")
                wall.setdefault(name, []).extend(r["time/rollout_s"] + r["time/update_s"] + r["time/log_s"]
                                                 for r in rows)
                cpu.setdefault(name, []).extend(r["time/cpu_s"] for r in rows)
                rss[name] = max([rss.get(name, 0)] + [r["mem/peak_mb"] for r in rows])
            if args.trl_python:
                workdir = tempfile.mkdtemp(prefix="bench_")
                t = run_trl(a, policy, reward, os.path.abspath(prompts), workdir)
                shutil.rmtree(workdir)
                if "failed" in t:
                    row["trl_failed"] = t["failed"]
                else:  # the script reports its own medians: one figure per round
                    wall.setdefault("trl", []).append(t["median_update_s"])
                    cpu.setdefault("trl", []).append(t["median_cpu_s"])
                    rss["trl"] = max(rss.get("trl", 0), t["peak_rss_mb"])
            floor = measure_floor(tyro.cli(ppo.Args, args=flags), args.updates)
            wall.setdefault("floor", []).extend(f["update_s"] for f in floor)
            cpu.setdefault("floor", []).extend(f["cpu_s"] for f in floor)
        for name in wall:
            row[f"{name}_wall_s"], row[f"{name}_cpu_s"] = median(wall[name]), median(cpu[name])
            if name in rss:
                row[f"{name}_rss_mb"] = rss[name]
        row["rounds"] = args.rounds
        table = save_row(row, os.path.join("experiments", "scaling.json"))
        print(json.dumps(row), flush=True)
    plot_scaling([r for r in table if not r.get("flags")], os.path.join("experiments", "scaling_memory.png"))
    print("\n" + "\n".join(scaling_table(table)))


def scaling_table(table):
    """The table as markdown lines: CPU s per update, the ratios, peak RSS; points in order, flagged rows last."""
    lines = ["| vocabulary | response | body | ppo.py | plain head | TRL 1.12 | floor | ppo.py / TRL | ppo.py / plain "
             "| over floor | ppo.py MB | plain MB | TRL MB | / TRL | / plain | runs |", "|---|---:|---|" + "---:|" * 13]
    def order(r):
        return r.get("flags", ""), list(VOCABS).index(r["vocab"]), r["length"], list(BODIES).index(r["body"])

    def ratio(a, b):
        return f"{r[a] / r[b]:.2f}" if a in r and b in r else "-"
    for r in sorted(table, key=order):
        trl = "trl_cpu_s" in r
        trl_cell = f"{r['trl_cpu_s']:.1f}" if trl else r.get("trl_failed", "-")[:40]  # TRL's error, if it failed
        cells = [r["vocab"], f"{r['length']:,}", f"{r['body']} {r.get('flags', '')}".strip(),
                 f"{r['ours_cpu_s']:.1f}", f"{r['plain_cpu_s']:.1f}", trl_cell, f"{r['floor_cpu_s']:.1f}",
                 f"**{ratio('ours_cpu_s', 'trl_cpu_s')}**" if trl else "-", ratio("ours_cpu_s", "plain_cpu_s"),
                 f"{r['ours_cpu_s'] / r['floor_cpu_s'] - 1:+.1%}",
                 *(f"{r[k]:,.0f}" if k in r else "-" for k in ("ours_rss_mb", "plain_rss_mb", "trl_rss_mb")),
                 f"**{ratio('ours_rss_mb', 'trl_rss_mb')}**" if trl else "-", ratio("ours_rss_mb", "plain_rss_mb"),
                 f"{r.get('rounds', 1)}, {r.get('date', '')}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def save_row(row, path):
    """Merge one point's row into the table on disk; returns the whole table."""
    table = json.load(open(path)) if os.path.exists(path) else []
    same = (row["point"], row["flags"])
    table = [r for r in table if (r["point"], r.get("flags", "")) != same] + [row]
    with open(path + ".tmp", "w") as f:
        json.dump(table, f, indent=1)
    os.replace(path + ".tmp", path)
    return table


def spread(args, rows=32, micro=4, repeats=3):
    """The rollout passes and 2 epochs of the update on one batch whose responses run from 8 to 256 tokens
    (uniform; one of 256), at the 32k / 10M scaling point: micro-batches of `micro` rows in order, each padded to
    its longest, against rows sorted by length and packed up to `micro` x (P + 256) tokens, the same largest
    micro-batch and so the same peak of activations. CPU seconds, the best of `repeats`."""
    policy_path, reward_path = scaling_checkpoint("32k", "10M")
    pargs = tyro.cli(ppo.Args, args=["--model", policy_path, "--reward-model", reward_path, "--critic-init", "reward",
                                     "--response-length", "256", "--num-ppo-epochs", "2"])
    ppo.check_args(pargs, 1)
    models = ppo.load_models(pargs, torch.device("cpu"), lambda *a, **k: None)
    g = torch.Generator().manual_seed(0)
    P, T = 16, 256
    lengths = torch.randint(8, T + 1, (rows,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T) < lengths[:, None]).float()  # (B, T)
    qr = torch.randint(10, models.policy.config.vocab_size, (rows, P + T), generator=g)  # (B, P+T)
    am = torch.cat([torch.ones(rows, P, dtype=torch.long), mask.long()], 1)  # (B, P+T)
    out = {}
    for name, split in (("micro_batch_size", dict(micro_batch_size=micro)),
                        ("micro_batch_tokens", dict(micro_batch_tokens=micro * (P + T)))):
        a = ppo.Args(**{**vars(pargs), **split})
        times = []
        for _ in range(repeats):
            t0 = time.process_time()
            logprobs, ref, entropy, values, next_values, *_ = ppo.rollout_passes(
                models.policy, models.ref_policy, models.critic, qr, am, mask, P, a.micro_batch_size or rows,
                a.temperature, None, a.logprob_chunk, a.micro_batch_tokens)
            rollout = SimpleNamespace(  # the fields of ppo.Rollout that minibatch_backward reads
                query_responses=qr, attention_mask=am, lengths=lengths, mask=mask, logprobs=logprobs,
                ref_logprobs=ref, values=values, returns=values + torch.randn_like(values),
                advantages=torch.randn_like(values) * mask, has_eos=torch.ones(rows, dtype=torch.bool), kl_coef=0.05)
            for _ in range(a.num_ppo_epochs):
                ppo.minibatch_backward(models.policy, models.critic, rollout, torch.randperm(rows), P, a)
            times.append(time.process_time() - t0)
        parts = ppo.micro_batches(lengths, P, a.micro_batch_size or rows, a.micro_batch_tokens)
        out[name] = {"cpu_s": min(times), "micro_batches": len(parts),
                     "largest_padded_tokens": max(len(p) * (P + int(lengths[p].max())) for p in parts)}
    out["ratio"] = out["micro_batch_tokens"]["cpu_s"] / out["micro_batch_size"]["cpu_s"]
    print(json.dumps(out))


def plot_scaling(table, path):
    """Peak RSS against the vocabulary (at 256 tokens, 10M) and against the response length (at 152k, 10M)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, (axis, fixed, xs) in zip(axes, (("vocab", dict(length=256, body="10M"), ("8k", "32k", "152k")),
                                            ("length", dict(vocab="152k", body="10M"), (64, 256, 1024)))):
        rows = {r[axis]: r for r in table if all(r[k] == v for k, v in fixed.items())}
        xs = [x for x in xs if x in rows]
        for who, label in (("ours", "ppo.py"), ("plain", "ppo.py --logprob-chunk 0"), ("trl", "TRL 1.12")):
            pts = [(str(x), rows[x][f"{who}_rss_mb"] / 1024) for x in xs if f"{who}_rss_mb" in rows[x]]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        ax.set_xlabel("vocabulary (256-token responses)" if axis == "vocab" else "response length (vocabulary 152k)")
        ax.set_ylabel("peak RSS (GB)"), ax.set_ylim(bottom=0), ax.legend()
    fig.suptitle("batch 4, 10M-parameter body, 2 PPO epochs, CPU", fontsize=9)
    fig.tight_layout(), fig.savefig(path, dpi=80)


if __name__ == "__main__":
    args, extra = tyro.cli(Args, return_unknown_args=True)
    if args.scaling:
        os.chdir(os.path.dirname(os.path.abspath(__file__)))
        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
        scaling(args, extra)
    elif args.spread:
        os.chdir(os.path.dirname(os.path.abspath(__file__)))
        transformers.utils.logging.set_verbosity_error()
        spread(args)
    else:
        main(args, extra)
