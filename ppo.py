"""PPO for language models with a critic, in one file: read it top to bottom, fork it, ablate a line.

    python ppo.py                                  # the built-in toy world, on a laptop CPU
    python ppo.py --model PATH --reward-model PATH # your HF causal LM and scalar reward model
    torchrun --nproc_per_node=8 ppo.py --model PATH --reward-model PATH   # FSDP2 over 8 GPUs

One update is the ten numbered phases of `main`'s loop (README, docs/loop.md); the four models: docs/code-notes.md.

Choices worth knowing (each one broke a real trainer somewhere):
- Every log-prob (old, reference, new) and the entropy come from logits / tau in fp32: the sampler drew from
  softmax(logits / tau). Dropout is off and position ids come from the attention mask, so rollout and training
  passes compute one function (phase 8 checks it).
- One set of stop ids ends a response everywhere (generation, mask, score slot, vLLM): the checkpoint's
  generation_config eos ids, its EOS and its chat template's end of turn.
- Masks come from the response lengths, never from `token != pad`; the score lands on the last real token (TRL and
  N+ put it one slot after the EOS: the same advantages at lambda 1 only).
- A response cut by the length limit is unfinished: --missing-eos-penalty replaces its score (N+), or
  --bootstrap-truncated takes the critic's value at the cut, or --overlong-filter drops it (DAPO).
- Losses are sums over tokens divided by the valid tokens of the whole minibatch (all micro-batches, all ranks), so
  neither micro-batches nor ranks change the gradient. The value loss clips around the rollout-time values.
- Every random draw is keyed by (seed, update, a row's place in the global batch), never by rank: N ranks run the
  run of one, and a (sharded) checkpoint resumes on any number of ranks.
- Agents' episodes (--env) keep the sampled token ids and append each observation's tokens once; an action mask
  stands in for the response mask; each step's reward sits on its turn's last token; GAE runs over the agent's tokens.
- top-p / top-k are refused unless --keep-sampling-mask scores every pass on the sampler's support.
- With two AdamW optimisers, --vf-coef matters only through clipping and Adam's epsilon; kept to compare with N+.

Reading order: the flags, the algorithm (tensors in, tensors out, in phase order), `main`, then the plumbing.
Shapes: B rollouts per update (b in a micro-batch), P prompt tokens (left-padded), T response tokens, V vocabulary.
"""
import contextlib
import importlib
import json
import math
import os
import random
import re
import resource
import shutil
import signal
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Annotated, Literal, NamedTuple, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.utils.checkpoint
import torch.nn as nn
import tyro
from tqdm import tqdm
import transformers
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                          GenerationConfig)

import adapters  # glue to the optional libraries: reasoning-gym's tasks, TextArena's games, peft's files
from runfiles import (discard, file_digests, list_checkpoints, lock_run, truncate_jsonl, unlock_run,  # the
                      write_json, choose_checkpoint as checkpoint_to_resume)  # run folder: what a kill must not break
from gae import compute_gae_over_actions

warnings.filterwarnings("ignore", "torch.distributed is disabled")  # (one process saves a checkpoint too: as intended)


# ==============================================================================================
# Flags: what to train on first, then in the order of the loop (docs/flags.md says more of each)
# ==============================================================================================
# an optional flag: None is off or a default set by other flags, as its help says (so no tyro "(default: None)")
def Opt(t, metavar=None):
    hint = lambda default: "" if default == "None" else f"(default: {default})"  # noqa: E731
    return Annotated[Optional[t], tyro.conf.arg(metavar=metavar, help_behavior_hint=hint)]


OptInt, OptFloat, OptStr = Opt(int, "INT"), Opt(float, "FLOAT"), Opt(str, "STR")
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}  # --precision and --sampler-precision's autocast dtypes


# --rollout-correction: mode -> (veRL 0.9.1's setting it equals, default low and high bounds of the mode's ratio)
ROLLOUT_CORRECTIONS = {
    "token-is": ('rollout_is="token", a cap', None, 2.0),  # truncated IS (Yao et al. 2025; veRL decoupled_token_is)
    "seq-is": ('rollout_is="sequence", a cap', None, 2.0),  # one weight a response (veRL decoupled_seq_is)
    "icepop": ('rollout_is="token", "lo_hi"', 0.5, 5.0),  # IcePop (Ring-1T, 2025): weights outside [0.5, 5] zeroed
    "token-mask": ('rollout_rs="token_k1"', 1 / 3, 3.0),  # TRL GRPO's cap 3.0; veRL's lower bound: its reciprocal
    "seq-mask": ('rollout_rs="seq_sum_k1"', 1 / 3, 3.0),  # TRL GRPO's default (sequence_mask, cap 3.0)
    "geo-mask": ('rollout_rs="seq_mean_k1"', 0.999, 1.001),  # geometric mean (veRL decoupled_geo_rs)
    "decoupled": ("none: AReaL's behav_imp_weight_cap", 0.0, 5.0),  # Fu et al. 2025: weights above 5 zeroed
}


@dataclass
class Args:
    # what to train, on what
    model: str = "toy"
    """an HF causal LM, or a built-in world: toy, chain, guess (docs/worlds.md)"""
    dataset: OptStr = None
    """a prompt file, a hub dataset or reasoning-gym:NAME (None: the world's own)"""
    reward_fn: OptStr = None
    """FILE.py:NAME (or module:NAME): f(prompts, responses, **columns) -> floats (None: the world's or task's own)"""
    reward_model: OptStr = None
    """an HF sequence classifier, one label (None: the toy's own unless --reward-fn)"""
    total_episodes: int = 64 * 100
    """prompts to train on in all: updates = total_episodes // batch_size"""
    batch_size: int = 64
    """rollouts per update"""
    learning_rate: float = 3e-4
    """actor AdamW rate, for the toy's 130K parameters (N+: 3e-6 at 1B-6.9B)"""
    critic_learning_rate: float = 1e-3
    """critic AdamW rate (OpenRLHF: 9e-6 with the actor at 1e-6)"""
    seed: int = 1
    """seed of python, numpy and torch: the prompt order and the sampler"""
    run_name: OptStr = None
    """outputs go to runs/<run_name>/ (None: <exp_name>__<seed>__<unix time>)"""

    # 1-2. rollout: prompts, sampling, the end of a response
    response_length: OptInt = None
    """the most tokens a response, per turn with --env (None: 24; --model chain 40; guess's own)"""
    temperature: float = 0.7
    """sampling temperature tau; every log-prob is taken at it (N+)"""
    top_p: float = 1.0
    """nucleus sampling (1.0 = off); needs --keep-sampling-mask"""
    top_k: int = 0
    """top-k sampling (0 = off); needs --keep-sampling-mask"""
    keep_sampling_mask: bool = False
    """with top-p / top-k: every log-prob on the sampler's truncated support, kept from the rollout (DeepSeek-V3.2)"""
    stop_tokens: Opt(list[str]) = None
    """tokens that end a response (None: generation_config's eos ids, the EOS, the chat template's end of turn)"""
    group_size: int = 1
    """responses sampled per prompt, side by side (the groups of grpo / rloo)"""
    prompt_column: str = "prompt"
    """the prompts' column: strings, or chat messages for the chat template"""
    train_split: str = "train"
    """split of --dataset to train on"""
    eval_split: OptStr = None
    """split of --dataset to evaluate on (None: --eval-fraction of its prompts)"""
    eval_fraction: float = 0.05
    """share of distinct prompts held out to evaluate, without --eval-split"""
    max_prompt_length: int = 128
    """the most prompt tokens"""
    truncate_prompts: bool = False
    """keep a longer prompt's last --max-prompt-length tokens (and count them; else refused)"""
    dataset_options: OptStr = None
    """reasoning-gym:NAME's generator options as JSON: '{"max_terms": 2}' (None: the task's own)"""
    answer_format: Literal["tag", "raw", "number"] = "tag"
    """reasoning-gym:NAME: the answer in <answer> tags (its convention), the whole response, or its last number"""

    # 3. the score, and what a response cut by the length limit gets
    reward_model_weight: float = 1.0
    """weight of the reward model's score in the total score"""
    reward_fn_weight: float = 1.0
    """weight of --reward-fn in the total score"""
    missing_eos_penalty: OptFloat = -1.0
    """the score of a response without EOS, instead of its own (N+; None = off)"""
    bootstrap_truncated: bool = False
    """a response without EOS keeps the critic's value after the cut as its future (GAE; --missing-eos-penalty None)"""
    overlong_filter: bool = False
    """responses without EOS leave the losses (DAPO's over-long filtering)"""
    overlong_buffer: OptInt = None
    """DAPO's soft length penalty: 0 this many tokens before the limit, -1 at it (None: off)"""

    # 4. reward and KL
    kl_coef: float = 0.05
    """beta, the per-token KL penalty (N+: 0.05; InstructGPT: 0.02)"""
    kl_estimator: Opt(Literal["k1", "k2", "k3", "abs"]) = None
    """per-token KL estimate, joschu.net/blog/kl-approx.html (None: k1 in the reward, k3 in the loss as GRPO)"""
    kl_in_loss: bool = False
    """beta * KL in the loss (GRPO) instead of the reward (InstructGPT)"""
    kl_target: OptFloat = None
    """adaptive beta's target KL per response (Ziegler et al. 2019; None = fixed)"""
    kl_horizon: int = 10000
    """horizon of the adaptive controller, in episodes (Ziegler et al. 2019)"""
    whiten_rewards: bool = False
    """scale per-token rewards to unit variance, mean kept (off in N+)"""
    ref_model: OptStr = None
    """the frozen reference of the KL penalty (None: --model)"""
    unread_reference: bool = False
    """at --kl-coef 0 load the reference and run its pass anyway (the textbook's; False: neither, as TRL)"""
    teacher: OptStr = None
    """on-policy distillation's teacher: a causal LM with --model's tokenizer (None: none)"""
    distill: Literal["reward", "loss"] = "reward"
    """--teacher: a token's reward -coef (log p - log p_teacher), or a loss"""
    distill_coef: float = 1.0
    """the weight of --teacher's term (--distill)"""
    distill_beta: float = 1.0
    """--distill loss's divergence: 0 KL(teacher||policy), 1 KL(policy||teacher)"""

    # 5-6. advantages
    adv_estimator: Literal["gae", "grpo", "rloo"] = "gae"
    """gae with the critic; or critic-free over each prompt's group: grpo (score - mean) / std, rloo (leave-one-out)"""
    gamma: float = 1.0
    """discount; 1 for bounded responses (N+)"""
    lam: float = 0.95
    """GAE lambda (N+)"""
    critic_lam: OptFloat = None
    """decoupled GAE: a lambda of the critic's own (VAPO: 1.0; None = --lam)"""
    lam_alpha: OptFloat = None
    """VAPO's length-adaptive lambda for the policy, 1 - 1 / (alpha * length) in [0, 1] (VAPO: 0.05; None = off)"""
    group_std: bool = True
    """grpo: divide by the group's standard deviation (Dr. GRPO drops it)"""
    dynamic_sampling: bool = False
    """grpo / rloo: drop the groups all right or all wrong and refill from new questions (DAPO)"""
    dynamic_sampling_rounds: int = 3
    """most refill rounds of --dynamic-sampling per update, a batch of prompts each"""
    whiten_advantages: Opt(bool) = None
    """mean 0, std 1 over the loss's tokens (None: gae on; grpo / rloo off, centred per group)"""
    critic_init: Literal["auto", "reward", "policy", "scratch"] = "auto"
    """critic start (auto: the reward model, as InstructGPT and N+, where it shares the policy's tokenizer)"""
    critic_model: OptStr = None
    """start the critic from this checkpoint instead, a fresh scalar head unless it has one (None: --critic-init)"""

    # 7. the PPO update
    num_ppo_epochs: int = 4
    """K, passes over each rollout batch (N+)"""
    old_logprobs: Literal["auto", "recompute", "on-policy", "sampler"] = "auto"
    """old log-probs: a no-grad pass, the loss's forward (1 epoch, 1 minibatch, beta 0), the sampler's (auto: 2nd)"""
    num_minibatches: int = 1
    """optimizer steps per epoch, batch_size / num_minibatches rollouts each"""
    micro_batch_size: OptInt = None
    """rollouts per forward and backward on a rank, memory only (None: a rank's whole minibatch)"""
    micro_batch_tokens: OptInt = None
    """instead: length-sorted micro-batches of at most this many tokens (veRL; None = off)"""
    policy_loss: Literal["ppo", "gspo", "cispo"] = "ppo"
    """ppo clips each token's ratio; gspo each response's (Zheng et al. 2025); cispo the weight, detached (MiniMax)"""
    clip_eps: OptFloat = None
    """policy ratio clip (None: 0.2, N+; 3e-4 with gspo, the GSPO paper's)"""
    clip_eps_high: OptFloat = None
    """asymmetric upper clip 1 + clip_eps_high (DAPO: 0.28; None: --clip-eps, or 4e-4 with gspo)"""
    dual_clip: OptFloat = None
    """dual clip for A < 0: the loss at most -c * A (Ye et al. 2020: c = 3; None = off)"""
    cispo_cap: float = 5.0
    """cispo: the importance weight's upper bound, no lower one (ScaleRL, TRL: 5; veRL: clip_ratio_high = cap - 1)"""
    loss_agg: Opt(Literal["token-mean", "seq-mean-token-mean", "seq-sum-norm"]) = None
    """tokens equal, responses equal, or a constant divisor (Dr. GRPO) (None: token-mean; seq-mean-token-mean, gspo)"""
    value_clip_eps: OptFloat = 0.2
    """value clip around the rollout-time values (N+: 0.2; None = off)"""
    vf_coef: float = 0.1
    """value loss coefficient (N+)"""
    ent_coef: float = 0.0
    """entropy bonus coefficient (0 = off)"""
    target_kl: OptFloat = None
    """stop the epochs at a minibatch approx-KL above this (CleanRL; None = off)"""
    critic_warmup_updates: int = 0
    """updates training only the critic before the policy moves (VAPO)"""
    ptx_coef: float = 0.0
    """PPO-ptx (InstructGPT): weight of an LM loss on --ptx-dataset (0 = off)"""
    ptx_dataset: OptStr = None
    """PPO-ptx's texts, a file with a `text` column (None: the toy's SFT corpus, else none)"""
    fused_adamw: bool = True
    """AdamW's fused kernel where the device has one (the log says which)"""
    max_grad_norm: float = 1.0
    """clip each model's gradient norm to this (0 = off)"""
    anneal_lr: bool = True
    """decay both learning rates linearly to 0 over the run"""

    # 8. health check
    ratio_check_tol: OptFloat = None
    """the most mean |ratio - 1| on the first minibatch before any step (None: 1e-2; a sampler 5e-2; stale, off)"""
    max_nonfinite_steps: int = 3
    """stop after this many steps in a row skipped for a non-finite loss or gradient"""

    # agents: multi-turn episodes
    env: OptStr = None
    """an environment class FILE.py:NAME or module:NAME (docs/agents.md), a TextArena game textarena/ID (None: none)"""
    max_turns: OptInt = None
    """the most agent turns of an episode (None: 1; guess's own)"""
    max_episode_tokens: OptInt = None
    """the most tokens after the first observation (None: max_turns x response_length + 64 per observation)"""
    gae_across_observations: bool = True
    """--env: GAE's trace runs on over observations (False, an ablation: it restarts at each turn's end)"""
    tools: OptStr = None
    """FILE.py:NAME[,NAME...]: functions the model may call via its chat template (None: none)"""
    max_tool_calls: int = 8
    """--tools: the most calls an episode runs (it ends at a response calling none)"""

    # LoRA (peft)
    lora_rank: int = 0
    """LoRA on the policy and the critic; 0 = full fine-tuning (LoRA Without Regret: rank 1-32, 10x the rate)"""
    lora_alpha: float = 32.0
    """LoRA's scale is alpha / rank (LoRA Without Regret: 32 for every rank)"""
    lora_base_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """the frozen bases' dtype (auto: bf16 with bf16 forwards on one process, where autocast rounds them anyway)"""
    lora_targets: str = "all-linear"
    """modules with adapters: peft's all-linear (every linear layer but the head) or names, q_proj,v_proj"""

    # scale and engine
    vllm: bool = False
    """generate with a vLLM engine in this process (one per rank), fed the new weights after every update"""
    vllm_gpu_memory_utilization: float = 0.3
    """share of the GPU's memory for the vLLM engine (weights and KV cache)"""
    vllm_sleep: bool = True
    """free the engine's weights and KV cache during the PPO epochs (GPU only)"""
    async_steps: Literal[0, 1] = 0
    """1: a second process samples the next batch while this one trains, on weights one update older (docs/async.md)"""
    sampler_precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """the sampler's forwards (auto: vLLM bf16 on a GPU, fp32 on a CPU; HF as --precision, its log-probs not kept)"""
    rollout_correction: Opt(Literal[tuple(ROLLOUT_CORRECTIONS)]) = None
    """weight or mask the losses where sampler and trainer disagree, as veRL 0.9.1 (docs/mismatch.md; None = off)"""
    rollout_correction_low: OptFloat = None
    """lowest ratio kept (0: none, None: mode's): p_trainer / p_sampler in IS modes, p_sampler / p_trainer in masks"""
    rollout_correction_high: OptFloat = None
    """highest ratio kept (IS modes: the weights' cap), the ratio of --rollout-correction-low (None: the mode's)"""
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """every forward under this autocast, all else fp32; fp16 scales the loss (auto: bf16 on a GPU, fp32 on a CPU)"""
    fp32_head: bool = False
    """the head's matmul in fp32 under autocast: the log-probs' largest rounding gone (docs/precision.md)"""
    logprob_chunk: int = 256
    """the head on this many tokens at once: no (b, T, V) logits (0 = all at once)"""
    pack: bool = True
    """every pass on the real tokens end to end, no padding"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward (less memory, about 30% slower)"""
    shard_frozen: bool = True
    """under torchrun, shard the reference, teacher and reward model too (False: a whole copy on each rank)"""
    offload_frozen: bool = False
    """keep the reference, teacher and reward model on the CPU but in their passes"""
    trust_remote_code: bool = False
    """let checkpoints run their own code (only for checkpoints you trust)"""

    # 10. logging, evaluation, checkpoints
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment: a copy ppo_idea.py logs under its own name"""
    track: bool = False
    """mirror metrics and samples to wandb (WANDB_MODE=offline works offline)"""
    wandb_project: str = "ppo-llm"
    """the wandb project"""
    sample_every: int = 10
    """a few (prompt, response, score) rows every this many updates (0 = never)"""
    eval_every: int = 0
    """evaluate every this many updates, and at the end (0 = never)"""
    eval_greedy: bool = False
    """evaluate greedy responses instead of samples at --temperature"""
    eval_size: int = 256
    """the most evaluation prompts"""
    eval_samples: int = 1
    """k samples per eval prompt: eval/pass@1 .. pass@k, unbiased (Chen et al. 2021)"""
    pass_threshold: float = 1.0
    """a response passes at this score or above (1.0: a verifiable reward's right)"""
    keep_best: OptStr = None
    """also save the models to runs/<run>/best/ when this eval metric (eval/score) is the highest yet (None = off)"""
    save_every: int = 25
    """a resumable checkpoint every this many updates (0 = only the final models)"""
    keep_checkpoints: int = 2
    """how many of the newest checkpoints to keep"""
    resume: OptStr = None
    """a checkpoint folder to continue from, or auto: the newest whole one of --run-name (None: a new run)"""
    debug: bool = False
    """show Python tracebacks instead of one-line errors"""

    episodes = property(lambda self: f"--tools {self.tools}" if self.tools else f"--env {self.env}")  # (in errors)

    def fill_defaults(self, world):
        """The defaults that depend on other flags, each as its flag's help states it (config.json holds the result)."""
        if self.model == "guess":  # the multi-turn world's env and limits
            import guess
            self.env, self.max_turns = self.env or guess.ENV, self.max_turns or guess.MAX_TURNS
            self.response_length = self.response_length or guess.RESPONSE_LENGTH
        if self.response_length is None:
            self.response_length = 40 if self.model == "chain" else 24  # chain: its longest worked answer is 35
        if self.model == "chain" and self.reward_model is None and self.reward_fn is None:
            self.reward_fn = "chain:reward"  # the chain world's verifiable reward
        if (self.dataset or "").startswith("reasoning-gym:") and self.reward_model is None and self.reward_fn is None:
            self.reward_fn = "reasoning-gym"  # the task's own score_answer (`reasoning_gym_reward`, adapters.py)
        self.max_turns = self.max_turns or (self.max_tool_calls + 1 if self.tools else 1)  # (--tools: and the answer)
        if self.max_episode_tokens is None:  # the turns, and room for an observation between two
            self.max_episode_tokens = self.max_turns * self.response_length + (self.max_turns - 1) * 64
        if self.kl_estimator is None:  # k1 is unbiased in the reward; in the loss its gradient has no reference
            self.kl_estimator = "k3" if self.kl_in_loss else "k1"
        gspo = self.policy_loss == "gspo"  # GSPO's ratios sit near 1 (a mean log-ratio): its paper clips at 3e-4, 4e-4
        if self.clip_eps_high is None and gspo:
            self.clip_eps_high = 4e-4 if self.clip_eps is None else self.clip_eps
        if self.clip_eps is None and self.policy_loss != "cispo":  # (cispo clips the weight, at --cispo-cap)
            self.clip_eps = 3e-4 if gspo else 0.2
        self.loss_agg = self.loss_agg or ("seq-mean-token-mean" if gspo else "token-mean")  # GSPO: one ratio a response
        if self.async_steps and self.rollout_correction is None and self.old_logprobs != "sampler":
            self.rollout_correction = "decoupled"  # AReaL's decoupled PPO: tokens weighted proximal / behaviour, capped
        if self.old_logprobs == "auto":  # the ratio is 1 by construction: nothing moves the policy before the
            on_policy = (self.num_ppo_epochs, self.num_minibatches, self.kl_coef) == (1, 1, 0)  # one step, and nothing
            on_policy &= not (self.unread_reference or self.rollout_correction or self.keep_sampling_mask  # read them
                              or self.teacher and self.distill == "reward")
            self.old_logprobs = "on-policy" if on_policy else "recompute"
        if self.ratio_check_tol is None:  # against the sampler its gap counts too; off where it is stale (async)
            self.ratio_check_tol = 1e-2 if self.old_logprobs == "recompute" else math.inf if self.async_steps else 5e-2
        if self.whiten_advantages is None:  # GRPO, RLOO, Dr. GRPO and veRL do not whiten group advantages again
            self.whiten_advantages = ESTIMATORS[self.adv_estimator]["whiten"]
        if self.rollout_correction:  # the mode's published bounds (ROLLOUT_CORRECTIONS), where not given
            low, high = ROLLOUT_CORRECTIONS[self.rollout_correction][1:]
            self.rollout_correction_low = low if self.rollout_correction_low is None else self.rollout_correction_low
            self.rollout_correction_high = (high if self.rollout_correction_high is None
                                            else self.rollout_correction_high)  # (0 is refused, not the default)
        bf16_forwards = self.precision == "bf16" or (self.precision == "auto" and torch.cuda.is_available())
        if self.lora_base_dtype == "auto":  # FSDP2 shards one dtype per layer: fp32 under torchrun
            self.lora_base_dtype = "bf16" if self.lora_rank and bf16_forwards and world == 1 else "fp32"


# ==============================================================================================
# The algorithm: tensors in, tensors out, in the order of the phases
# ==============================================================================================

# --- across ranks (torchrun): sums, themselves on one process ---------------------------------
def global_sum(x):
    """Sum of a tensor over all ranks (itself on one process): N ranks run the algorithm of one."""
    if dist.is_initialized():
        x = x.clone()
        dist.all_reduce(x)
    return x


# --- phases 1-2: generate, cut after the first EOS; then dynamic sampling (agents' episodes: `play`) ---
# each random stream's tag, its NumPy seed's second word: NumPy seeds keys that differ only in length alike
STREAMS = dict(prompts=1, rows=2, minibatches=3, refills=4, ptx=5)


def minibatch_order(args, update, epoch, n):
    """This rank's n rows in minibatch order (M slices): every M rows side by side in the global batch are dealt one
    to each minibatch, in an order drawn from (seed, update, epoch), so a minibatch holds the same rows on any
    number of ranks (a per-rank shuffle's would differ)."""
    rank, world, M = *rank_and_world(), args.num_minibatches
    deal = np.tile(np.arange(M), (-(-n * world // M), 1))  # (B / M, M): each row a deal of the M minibatches
    deal = np.random.default_rng([args.seed, STREAMS["minibatches"], update, epoch]).permuted(deal, axis=1)
    return torch.from_numpy(np.argsort(deal.ravel()[rank * n: (rank + 1) * n], kind="stable"))  # (n,)


def prompt_order(update, n_rows, args, rank, local_batch):
    """This rank's prompt rows of an update: each pass over the prompts in a fresh order seeded by (seed, pass)."""
    n_prompts = args.batch_size // args.group_size
    start = (update - 1) * n_prompts
    order = np.concatenate([np.random.default_rng([args.seed, STREAMS["prompts"], k]).permutation(n_rows)
                            for k in range(start // n_rows, (start + n_prompts - 1) // n_rows + 1)])
    offset = start - (start // n_rows) * n_rows
    batch_idx = np.repeat(order[offset: offset + n_prompts], args.group_size)  # (B,): groups side by side
    return batch_idx[rank * local_batch: (rank + 1) * local_batch]  # (B / N,)


def generate(policy, tokenizer, prompt_ids, device, greedy=False, synced=False, llm=None, sampler=None, keys=None):
    """Left-pad, sample (HF or `llm`), cut after the first stop: `Sampled`'s query_responses .. engine_logprobs.
    `keys`: each row's random stream (None: drawn from torch's generator)."""
    sampling = policy.generation_config
    enc = tokenizer.pad({"input_ids": prompt_ids}, return_tensors="pt").to(device)
    queries, query_mask = enc.input_ids, enc.attention_mask  # (B, P), left-padded
    P = queries.shape[1]
    keys = keys or torch.randint(2**31, (len(prompt_ids),)).tolist()
    if llm is not None:
        responses, engine_logprobs = adapters.vllm_generate(llm, sampling, prompt_ids, keys, greedy,
                                                            tokenizer.pad_token_id, device)  # (B, T) each
    else:
        draw = None if greedy else KeyedSampler(keys, sampling, device)  # one-hot scores: greedy decoding samples
        with torch.no_grad(), sampler or contextlib.nullcontext():  # (--sampler-precision)
            # synced: a sharded model needs every rank in each forward, so all keep stepping until all stop
            out = policy.generate(input_ids=queries, attention_mask=query_mask, synced_gpus=synced, do_sample=False,
                                  temperature=None, top_k=None, top_p=None, logits_processor=[draw] if draw else None)
        responses = out[:, P:]  # (B, T), T <= response_length
        engine_logprobs = draw.logprobs() if draw and sampler else None  # (B, T): kept where a loss reads them
    stop_ids = torch.tensor(sampling.eos_token_id, device=device).flatten()  # (S,)
    lengths = response_lengths(responses, stop_ids)  # (B,)
    has_eos = torch.isin(responses, stop_ids).any(1)  # (B,): False = cut by the length limit
    T = int(lengths.max())
    mask = (torch.arange(T, device=device) < lengths[:, None]).float()  # (B, T)
    responses = responses[:, :T].masked_fill(mask == 0, tokenizer.pad_token_id)  # (B, T): padding after EOS
    query_responses = torch.cat([queries, responses], 1)  # (B, P+T)
    attention_mask = torch.cat([query_mask, mask.long()], 1)  # (B, P+T)
    if engine_logprobs is not None:
        engine_logprobs = engine_logprobs[:, :T] * mask  # (B, T)
    return query_responses, attention_mask, lengths, has_eos, mask, P, engine_logprobs


class Sampled(NamedTuple):
    """B rollouts after phases 1-2, scored: what `sample` returns and --dynamic-sampling filters and joins."""
    rows: list  # B prompt rows: the prompt and any extra columns (--env: the episode's row)
    query_responses: torch.Tensor  # (B, P+T)
    attention_mask: torch.Tensor  # (B, P+T)
    lengths: torch.Tensor  # (B,)
    has_eos: torch.Tensor  # (B,)
    mask: torch.Tensor  # (B, T): --env: the action mask, 1 on the agent's tokens only
    P: int
    engine_logprobs: Optional[torch.Tensor]  # (B, T): the sampler's (--vllm, --sampler-precision), else None
    turn_rewards: Optional[torch.Tensor]  # (B, T): --env, each step's reward on the last agent token of its turn
    turn_ends: Optional[torch.Tensor]  # (B, T): --env, 1 on the last agent token of each turn
    texts: list  # B decoded responses
    scores: torch.Tensor  # (B,): the total score, before phase 4's treatment of long responses
    score_parts: dict  # each weighted component's (B,)


def sample(models, args, rows, prompt_ids, idx, seeds, micro, amp, device, llm, greedy=False, drawn=None, keys=None):
    """Phases 1-2 on prompt rows `idx` (--env: episodes of them, `seeds`; `drawn`: --async-steps'), then the score.
    `keys`: each row's random stream (`row_keys`)."""
    policy, tokenizer, world = models.policy, models.tokenizer, rank_and_world()[1]
    rows, turn_rewards, turn_ends = [rows[i] for i in idx], None, None
    sampler = sampler_autocast(args, device)
    with amp:
        if models.env is None:  # (--async-steps: drawn already)
            qr, am, lengths, has_eos, mask, P, engine_logprobs = drawn or generate(
                policy, tokenizer, [prompt_ids[i] for i in idx], device, greedy, world > 1, llm, sampler, keys)
        else:  # multi-turn episodes: `mask` is the action mask, 1 on the agent's tokens only (see `play`)
            qr, am, lengths, has_eos, mask, P, engine_logprobs, turn_rewards, turn_ends = play(
                models.env, policy, tokenizer, rows, seeds, device, args, greedy, world > 1, llm, sampler, keys)
    texts = tokenizer.batch_decode([r[: int(n)] for r, n in zip(qr[:, P:], lengths)], skip_special_tokens=True)
    move(models.swapped, device)
    with torch.no_grad(), amp:
        scores, parts = score(models, args, rows, texts, qr, am, lengths, P, micro, turn_rewards)  # (B,)
    move(models.swapped, "cpu")
    return Sampled(rows, qr, am, lengths, has_eos, mask, P, engine_logprobs, turn_rewards, turn_ends, texts, scores,
                   parts)


def dynamic_sampling(batch, update, models, args, rows, prompt_ids, micro, amp, device, llm):
    """DAPO's dynamic sampling (Yu et al. 2025): drop the groups that all scored the same, refill; batch, metrics."""
    rank, world = rank_and_world()
    G, B = args.group_size, len(batch.lengths)
    # the question of each row, by text (gcd's 2,048 rows hold 364); with --env an episode is its row and its seed
    questions = np.arange(len(rows)) if models.env else np.unique([question(r) for r in rows], return_inverse=True)[1]
    kept, first, have, groups, tokens, rounds = [], batch, 0, 0, 0, 0
    for refill in range(args.dynamic_sampling_rounds + 1):  # 0: the batch as it came
        if refill > 0:
            idx = refill_order(update, refill, questions, args, rank, world)  # (<= B,), None: no new questions
            if idx is None:
                break
            batch = sample(models, args, rows, prompt_ids, idx, row_keys(args, update, (0, refill), rank, len(idx), G),
                           micro, amp, device, llm, keys=row_keys(args, update, (1, refill), rank, len(idx)))
            rounds = refill
        s = batch.scores.view(-1, G)  # (B / G, G): the task's scores
        signal = torch.nonzero((s != s[:, :1]).any(1)).squeeze(1)  # (n,): the groups whose scores differ
        kept.append(pick(batch, (signal[:, None] * G + torch.arange(G, device=device)).flatten()))  # (n G,)
        have, groups, tokens = have + len(signal), groups + len(s), tokens + batch.mask.sum().item()
        full = -global_max(-float(min(have, B // G)), device)  # the groups of the rank that holds the fewest
        if full == B // G:
            break
    n_groups, n_signal, n_tokens = global_sum(torch.tensor([groups, have, tokens], device=device)).tolist()
    metrics = {"sampling/dropped": 1 - n_signal / n_groups, "sampling/rounds": rounds,
               "sampling/trained_groups": full * world, "time/generated_tokens": n_tokens}
    if full == 0:
        return first, metrics
    return pick(join(kept, models.tokenizer.pad_token_id), torch.arange(int(full) * G, device=device)), metrics


def row_keys(args, update, stream, rank, n, group=1):
    """The random keys of this rank's n rows of an update, from (seed, update, stream) and each row's place in the
    global batch, so a row draws the same on any number of ranks; `group` rows side by side share one (a group's
    episodes). Streams: 0 the episodes' seeds, 1 the sampling (`KeyedSampler`), 2 evaluation; (s, r) refill r's."""
    key = [args.seed, STREAMS["rows"], update, *np.atleast_1d(stream)]
    keys = np.random.SeedSequence(key).generate_state(n * (rank + 1))[-n:]
    return [int(k) for k in keys[np.arange(n) // group * group]]  # (n,) uint32 each


# --- phase 3: log-probs, entropies and values in no-grad passes -------------------------------
# a row's positions (docs/code-notes.md draws them): the logits at P-1+t score a_t; V_t is the value before a_t
def move(models, device):
    for model in models:
        model.to(device)


def forward(model, query_responses, attention_mask, logits_to_keep=0, **kw):
    """Positions count real tokens only: with left padding, token i of a prompt sits at position i."""
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)  # (b, P+T)
    if getattr(model, "pack", False):  # (--pack) the rows' real tokens laid end to end, no padding
        return packed_forward(model, query_responses, position_ids, attention_mask.bool(), logits_to_keep, **kw)
    return model(input_ids=query_responses, attention_mask=attention_mask, position_ids=position_ids,
                 use_cache=False, logits_to_keep=logits_to_keep, **kw)


def logprobs_from_logits(logits, tokens, temperature, with_entropy=False, support=None):
    """Log-prob of `tokens` under softmax(logits / tau), truncated to `support` (b, T, V) bool if given; entropy."""
    logits = logits.float() if temperature == 1.0 else logits.float() / temperature  # (b, T, V) fp32; tau 1: no copy
    if support is not None:
        logits = logits.masked_fill(~support, -math.inf)  # (b, T, V)
    lse = torch.logsumexp(logits, -1)  # (b, T)
    logprobs = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - lse  # (b, T)
    if not with_entropy:
        return logprobs, None
    expected = (torch.softmax(logits, -1) * logits.nan_to_num(neginf=0.0)).sum(-1)  # (b, T): E[logit], 0 x -inf = 0
    return logprobs, lse - expected  # (b, T) each


def policy_logprobs(model, query_responses, attention_mask, P, temperature, with_entropy=False, keep=None, chunk=0,
                    states=None, sampler_filter=None):
    """Log-probs and entropies (b, T) of the response tokens, and their support as (position, token) pairs, or None;
    `states` (a list, with chunk > 0) receives the head's input states and the head."""
    if chunk > 0:  # the default (--logprob-chunk 256): the head on `chunk` tokens at a time, the same numbers as below
        return chunked_logprobs(model, query_responses, attention_mask, P, temperature, with_entropy, chunk, keep,
                                sampler_filter, states)
    b, T = query_responses.shape[0], query_responses.shape[1] - P
    logits = forward(model, query_responses, attention_mask, logits_to_keep=T + 1).logits[:, :-1]  # (b, T, V)
    if sampler_filter is not None:  # what the sampler kept (DeepSeek-V3.2), at the real positions only
        support = sampling_support(logits.float() / temperature, *sampler_filter, query_responses[:, P:])  # (b, T, V)
        keep = (support & attention_mask[:, P:, None].bool()).flatten(0, 1).nonzero(as_tuple=True)  # (N,) each
    support = None if keep is None else dense_support(keep, b * T, logits.shape[-1]).view(b, T, -1)  # (b, T, V)
    return *logprobs_from_logits(logits, query_responses[:, P:], temperature, with_entropy, support), keep


def state_values(value_model, query_responses, attention_mask, P):
    """V of each state, (b, T+1): column t the value before response token t, column `length` after the last one."""
    return forward(value_model, query_responses, attention_mask)[:, P - 1:]  # (b, T+1)


@torch.no_grad()
def rollout_passes(policy, ref_policy, critic, query_responses, attention_mask, mask, P, micro, temperature,
                   sampler_filter=None, chunk=0, budget=None, teacher=None):
    """Phase 3 but the score: old, reference and teacher log-probs, entropies, values (B, T), the next values (B,),
    support."""
    B, T = mask.shape
    lengths = attention_mask[:, P:].sum(1)  # (B,): the response's tokens (the episode's, observations included)
    logprobs = torch.zeros(B, T, device=mask.device)  # (B, T)
    ref_logprobs = torch.zeros_like(logprobs)  # (B, T)
    teacher_logprobs = None if teacher is None else torch.zeros_like(logprobs)  # (B, T)
    entropy = torch.full_like(logprobs, 0.0 if policy is not None else math.nan)  # (B, T): NaN until a pass fills it
    values_all = torch.zeros(B, T + 1, device=mask.device)  # (B, T+1)
    kept_pos, kept_tok, keep = [], [], None  # the sampler's support: (position in B*T, token id) pairs, not B x T x V
    for rows in micro_batches(lengths, P, micro, budget, packed_tokens(attention_mask, policy or ref_policy or critic)):
        t = int(lengths[rows].max())
        qr, am = query_responses[rows, :P + t], attention_mask[rows, :P + t]  # (b, P+t)
        if policy is not None:  # (skipped only where --keep-sampling-mask is off: `keep` stays None)
            logprobs[rows, :t], entropy[rows, :t], keep = policy_logprobs(
                policy, qr, am, P, temperature, with_entropy=True, sampler_filter=sampler_filter, chunk=chunk)
        if sampler_filter is not None:  # kept for every later pass of this batch (old and new log-probs alike)
            kept_pos.append(rows[keep[0] // t] * T + keep[0] % t)  # (N,): micro-batch position -> batch position
            kept_tok.append(keep[1])
        if ref_policy is not None:  # (b, t): on the policy's support
            ref_logprobs[rows, :t] = policy_logprobs(ref_policy, qr, am, P, temperature, keep=keep, chunk=chunk)[0]
        if teacher is not None:  # (b, t): the teacher in the reference's place, on the same support
            teacher_logprobs[rows, :t] = policy_logprobs(teacher, qr, am, P, temperature, keep=keep, chunk=chunk)[0]
        if critic is not None:
            values_all[rows, :t + 1] = state_values(critic, qr, am, P)  # (b, t+1)
    values = values_all[:, :T] * mask  # (B, T): V before each response token, 0 on padding
    next_values = values_all.gather(1, lengths[:, None]).squeeze(1)  # (B,): V after the last token
    support = pack_support(torch.cat(kept_pos), torch.cat(kept_tok), B * T) if sampler_filter else None
    return logprobs, ref_logprobs, entropy, values, next_values, support, teacher_logprobs


def score(models, args, rows, texts, query_responses, attention_mask, lengths, P, micro, turn_rewards=None):
    """The total score (B,) and each weighted component's: the reward model's, --reward-fn's, --env's return."""
    parts = {} if turn_rewards is None else {"env": turn_rewards.sum(1)}
    if models.reward_model is not None:
        rm_texts = None if models.rm_tokenizer is None else [  # the texts, for a reward model with its own tokens
            render_for_rm(models.rm_tokenizer, r["prompt"], t) for r, t in zip(rows, texts)]
        parts["reward_model"] = args.reward_model_weight * reward_model_scores(
            models.reward_model, models.rm_tokenizer, query_responses, attention_mask, lengths, P, rm_texts, micro,
            args.micro_batch_tokens)
    if models.reward_fn is not None:
        columns = {k: [r[k] for r in rows] for k in rows[0] if k not in ("prompt", args.prompt_column)}
        parts["reward_fn"] = args.reward_fn_weight * reward_fn_scores(
            models.reward_fn, args, [r["prompt"] for r in rows], texts, columns, lengths.device)
    return sum(parts.values(), torch.zeros(len(lengths), device=lengths.device)), parts  # (--teacher alone: 0)


# --- phase 4: KL and per-token rewards --------------------------------------------------------
def kl_penalty(logprobs, ref_logprobs, estimator):
    """Per-token KL(pi || pi_ref) estimate from samples of pi (http://joschu.net/blog/kl-approx.html)."""
    log_r = ref_logprobs - logprobs  # (B, T): log(p_ref / p)
    if estimator == "k1":
        return -log_r  # (B, T): unbiased, can be negative per token
    if estimator == "k2":
        return 0.5 * log_r ** 2  # (B, T): >= 0, biased, low variance
    if estimator == "abs":
        return log_r.abs()  # (B, T)
    if estimator == "k3":
        return torch.expm1(log_r) - log_r  # (B, T): k3 >= 0, unbiased, low variance
    fail(f"--kl-estimator {estimator!r} has no branch in kl_penalty (k1, k2, k3, abs)")  # (a fork's typo: no default)


def per_token_rewards(kl, scores, lengths, kl_coef, turn_rewards=None, distill=0.0):
    """-beta * KL_t (and --teacher's -coef * KL_t to it) on every token, plus the score on the last real token (--env:
    each step's on its turn's last)."""
    non_score_reward = -kl_coef * kl - distill  # (B, T)
    rewards = non_score_reward.clone()  # (B, T)
    last = (torch.arange(len(rewards)), lengths - 1)  # the episode ends on an agent token
    if turn_rewards is not None:
        earlier = turn_rewards.index_put(last, torch.zeros_like(scores))  # (B, T): the steps before the last
        rewards = rewards + earlier  # (B, T)
        scores = scores - earlier.sum(1)  # (B,)
    rewards[last] += scores
    return rewards, non_score_reward


def long_responses(scores, has_eos, lengths, next_values, args):
    """Scores of responses cut by the length limit or near it (N+, DAPO); the critic's value after the cut, or None."""
    bootstrap_value = None
    if args.missing_eos_penalty is not None:
        scores = torch.where(has_eos, scores, args.missing_eos_penalty)  # (B,)
    if args.bootstrap_truncated:
        if args.env is None:
            scores = torch.where(has_eos, scores, 0.0)  # (B,): truncated responses are not scored...
        bootstrap_value = torch.where(has_eos, 0.0, next_values)  # (B,): ...their future is estimated
    if args.overlong_buffer is not None:
        over = (lengths - (args.max_episode_tokens - args.overlong_buffer)).clamp(min=0)  # (B,): tokens into the buffer
        scores = scores - over / args.overlong_buffer  # (B,)
    return scores, bootstrap_value


def adaptive_kl_coef(kl_coef, kl, args):
    """Ziegler et al. 2019 (--kl-target): beta moves by the clipped relative error of the KL per response."""
    if args.kl_target is None:
        return kl_coef
    total, n = global_sum(torch.tensor([kl.sum().item(), float(len(kl))], device=kl.device)).tolist()  # all ranks
    error = float(np.clip(total / n / args.kl_target - 1, -0.2, 0.2))
    return kl_coef * (1 + error * n / args.kl_horizon)


# --- phases 5-6: group baselines and whitening (GAE is gae.py) --------------------------------
# each estimator's needs: a critic; groups of G >= 2 samples; whitening by default (GRPO, RLOO, Dr. GRPO, veRL: no)
ESTIMATORS = {"gae": dict(critic=True, groups=False, whiten=True),
              "grpo": dict(critic=False, groups=True, whiten=False),  # Shao et al. 2024
              "rloo": dict(critic=False, groups=True, whiten=False)}  # Ahmadian et al. 2024


def gae_advantages(rewards, values, mask, bootstrap_value, turn_ends, args):
    """GAE over the agent's tokens (gae.py), the critic's targets, and the lambda variants (VAPO's, the ablation)."""
    def gae(lam):
        if not args.gae_across_observations and turn_ends is not None:  # the ablation: lambda 0 on each turn's end
            lam = torch.as_tensor(lam, device=rewards.device).reshape(-1, 1) * (1 - turn_ends)  # (B, T)
        return compute_gae_over_actions(rewards, values, mask, args.gamma, lam, bootstrap_value)  # (B, T) each
    advantages, returns = gae(args.lam)  # (B, T) each
    if args.lam_alpha is not None:  # VAPO: the policy's lambda nears 1 with the length (the critic keeps --lam)
        advantages = gae((1 - 1 / (args.lam_alpha * mask.sum(1))).clamp(0, 1))[0]  # (B, T); lambda < 0 below 1/alpha
    if args.critic_lam is not None:  # decoupled GAE (VAPO): the critic's targets with their own lambda
        returns = gae(args.critic_lam)[1]  # (B, T)
    return advantages, returns


def group_advantages(seq_rewards, group_size, estimator, divide_by_std=True):
    """Critic-free advantages (B,) from each prompt's group_size responses, side by side in seq_rewards (B,)."""
    r = seq_rewards.view(-1, group_size)  # (B/G, G)
    if estimator == "grpo":  # against the group mean, over the group std (Shao et al. 2024)
        adv = r - r.mean(1, keepdim=True)  # (B/G, G)
        return (adv / (r.std(1, keepdim=True) + 1e-6) if divide_by_std else adv).view(-1)  # (B,)
    if estimator == "rloo":  # against the mean of the others (Ahmadian et al. 2024)
        return (r - (r.sum(1, keepdim=True) - r) / (group_size - 1)).view(-1)  # (B,)
    raise ValueError(f"no group advantage is defined for --adv-estimator {estimator!r}")


def masked_mean(x, mask):
    return global_sum((x * mask).sum()) / global_sum(mask.sum()).clamp(min=1)


def masked_var(x, mask):
    mean, n = masked_mean(x, mask), global_sum(mask.sum())
    return global_sum(((x - mean) ** 2 * mask).sum()) / (n - 1).clamp(min=1)  # unbiased (Bessel)


def masked_whiten(x, mask, shift_mean=True):
    """Mean 0 (unless shift_mean=False: the sign of a score survives), std 1, over valid entries."""
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask  # padding stays exactly 0


# --- phases 7-8: the losses, a minibatch's backward, the health check, a step; then GSPO, CISPO ---
@dataclass
class Rollout:
    """One update's batch on this rank, what phases 1-6 made of it, fixed through phase 7's K epochs."""
    query_responses: torch.Tensor  # (B, P+T): prompts left-padded, responses right-padded after the EOS
    attention_mask: torch.Tensor  # (B, P+T): 1 on real tokens
    lengths: torch.Tensor  # (B,): response tokens, the EOS included (--env: the episode's, observations too)
    mask: torch.Tensor  # (B, T): 1 on response tokens, 0 on padding (--env: 1 on the agent's tokens only)
    has_eos: torch.Tensor  # (B,): False = cut by the length limit (--env: not ended by the env)
    logprobs: torch.Tensor  # (B, T): the policy's at rollout time, PPO's old log-probs
    ref_logprobs: torch.Tensor  # (B, T): the reference's
    entropy: torch.Tensor  # (B, T): the policy's
    support: Optional[tuple]  # --keep-sampling-mask: the sampler's (offsets (B*T+1,), token ids (N,)), else None
    values: torch.Tensor  # (B, T): the critic's V before each response token, 0 on padding
    scores: torch.Tensor  # (B,): after phase 4's treatment of long responses
    kl: torch.Tensor  # (B, T): the per-token KL estimate, 0 on padding
    non_score_reward: torch.Tensor  # (B, T): -beta * kl
    rewards: torch.Tensor  # (B, T): phase 4's per-token rewards
    advantages: torch.Tensor  # (B, T): after phase 6
    returns: torch.Tensor  # (B, T): the critic's targets
    kl_coef: float  # beta for this update
    engine_logprobs: Optional[torch.Tensor] = None  # (B, T): the sampler's (--vllm, --sampler-precision), else None
    is_weights: Optional[torch.Tensor] = None  # (B, T): --rollout-correction's weights on the policy loss
    kept: Optional[torch.Tensor] = None  # (B, T): --rollout-correction, the mask of the tokens left in the losses
    corrected: Optional[torch.Tensor] = None  # (B, T): --rollout-correction, 1 where it capped, zeroed or masked
    turn_ends: Optional[torch.Tensor] = None  # (B, T): --env, 1 on the last agent token of each turn
    teacher_logprobs: Optional[torch.Tensor] = None  # (B, T): --teacher's, else None


def policy_loss(new_logprobs, old_logprobs, advantages, clip_eps, clip_eps_high=None, dual_clip=None):
    """Per-token clipped surrogate max(-A r, -A clip(r)): losses, ratio, logratio, clipped indicator, (b, t) each."""
    logratio = new_logprobs - old_logprobs  # (b, t)
    ratio = torch.exp(logratio)  # (b, t), fp32
    pg_losses = -advantages * ratio  # (b, t)
    high = clip_eps if clip_eps_high is None else clip_eps_high  # asymmetric clip (DAPO's clip-higher)
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_eps, 1 + high)  # (b, t)
    losses = torch.max(pg_losses, pg_losses2)  # (b, t): the pessimistic bound
    clipped = pg_losses2 > pg_losses  # (b, t): tokens whose gradient the clip removed
    if dual_clip is not None:  # A < 0 and a huge ratio: cap the loss at -c A, a constant (Ye et al. 2020)
        capped = (advantages < 0) & (losses > -dual_clip * advantages)  # (b, t): no gradient there either
        losses = torch.where(advantages < 0, torch.min(losses, -dual_clip * advantages), losses)  # (b, t): a tie
        # splits the gradient in two, as veRL's and AReaL's torch.min does
        clipped = clipped | capped  # (b, t)
    return losses, ratio, logratio, clipped.float()


def value_loss(new_values, old_values, returns, value_clip_eps):
    """Squared error, or the larger of it and that of the value clipped around the rollout-time one (not the new)."""
    vf_losses = (new_values - returns) ** 2  # (b, t)
    if value_clip_eps is None:
        return 0.5 * vf_losses, torch.zeros_like(vf_losses)  # (b, t) each
    v_clipped = old_values + torch.clamp(new_values - old_values, -value_clip_eps, value_clip_eps)  # (b, t)
    vf_losses2 = (v_clipped - returns) ** 2  # (b, t)
    binds = (new_values - old_values).abs() > value_clip_eps  # (b, t): where the clip binds (not one ulp off)
    return 0.5 * torch.max(vf_losses, vf_losses2), (binds & (vf_losses2 > vf_losses)).float()  # (b, t) each


def loss_weights(mask, lengths, mb_tokens, mb_seqs, mode, max_tokens):
    """Each valid token's weight in the policy loss of mb_seqs responses, mb_tokens tokens; `lengths` (b,) per row."""
    if mode == "token-mean":  # every token counts the same (long responses weigh more)
        return mask / mb_tokens  # (b, t)
    if mode == "seq-mean-token-mean":  # every response counts the same, whatever its length
        return mask / (lengths[:, None].clamp(min=1) * mb_seqs)  # (b, t): (a row without tokens adds 0, not NaN)
    if mode == "seq-sum-norm":  # Dr. GRPO: a constant divisor, no length bias
        return mask / (mb_seqs * max_tokens)  # (b, t)
    fail(f"--loss-agg {mode!r} has no branch in loss_weights (token-mean, seq-mean-token-mean, seq-sum-norm)")


def rollout_correction(logprobs, sampler_logprobs, mask, mode, low, high):
    """veRL 0.9.1's correction of the sampler-trainer gap: the policy loss's weights, the kept mask, where it acted."""
    # (B, T): log p_trainer / p_sampler, 0 off the agent's tokens; detached: weights change the measure, not the loss
    log_ratio = (logprobs - sampler_logprobs).detach() * mask
    if mode in ("token-is", "seq-is", "icepop", "decoupled"):  # IS weights, capped (TIS) or zeroed out of [low, high]
        if mode == "seq-is":  # one weight a response: the product of its tokens' ratios
            log_ratio = log_ratio.sum(1, keepdim=True)  # (B, 1)
        raw = torch.exp(log_ratio.clamp(-20, 20)) * mask  # (B, T): veRL bounds the log-ratio at +-20
        capped = mode in ("token-is", "seq-is")  # (a cap; icepop and decoupled zero the weights out of bounds)
        weights = raw.clamp(max=high) if capped else raw * ((raw >= low) & (raw <= high))  # (B, T)
        return weights, mask, (weights != raw).float() * mask
    if mode not in ("token-mask", "seq-mask", "geo-mask"):  # (a fork's typo: no default)
        fail(f"--rollout-correction {mode!r} has no branch in rollout_correction ({', '.join(ROLLOUT_CORRECTIONS)})")
    k1 = -log_ratio.clamp(-20, 20)  # (B, T): log p_sampler / p_trainer, the statistic veRL's masks bound
    if mode != "token-mask":  # seq-mask: its sum over the response; geo-mask: its mean, a geometric mean ratio
        k1 = k1.sum(1, keepdim=True) / (mask.sum(1, keepdim=True).clamp(min=1) if mode == "geo-mask" else 1)  # (B, 1)
    floor = math.log(low) if low > 0 else -math.inf  # (low 0: no lower bound)
    out = ((k1 < floor) | (k1 > math.log(high))).float() * mask  # (B, T): masked out of the losses
    return torch.ones_like(mask), mask - out, out


def minibatch_backward(policy, critic, rollout, mb_idx, P, args, amp=contextlib.nullcontext(), scaler=None, first=True,
                       teacher=None):
    """Accumulate one minibatch's gradient over micro-batches, weights normalised over the minibatch (all ranks)."""
    fill = first and args.old_logprobs != "recompute"
    mask, lengths = rollout.kept if args.rollout_correction else rollout.mask, rollout.lengths  # (B, T), (B,)
    if args.overlong_filter:  # DAPO: truncated responses leave the losses and their normalisers
        mask = mask * rollout.has_eos[:, None]  # (B, T)
    mb_tokens = global_sum(mask[mb_idx].sum()).clamp(min=1)  # valid tokens of the minibatch on all ranks
    mb_seqs = global_sum((mask[mb_idx].amax(1) > 0).sum().float()).clamp(min=1)  # responses in the loss, likewise
    world = dist.get_world_size() if dist.is_initialized() else 1  # FSDP averages gradients over ranks
    stats = dict(pg_loss=0.0, vf_loss=0.0, approxkl=0.0, pg_clip=0.0, vf_clip=0.0, ratio=0.0, ratio_dev=0.0,
                 tokens=0.0, ratio_dev_max=0.0, distill=0.0)
    for part in micro_batches(lengths[mb_idx], P, args.micro_batch_size or len(mb_idx), args.micro_batch_tokens,
                              packed_tokens(rollout.attention_mask[mb_idx], policy)):
        idx = mb_idx[part]  # (b,)
        t = int(lengths[idx].max())  # trim to the longest response of this micro-batch
        qr, am = rollout.query_responses[idx, :P + t], rollout.attention_mask[idx, :P + t]  # (b, P+t)
        mc_mask = mask[idx, :t]  # (b, t)
        keep = kept_pairs(rollout.support, idx, t, mask.shape[1]) if args.keep_sampling_mask else None  # their support
        states = None if teacher is None else []  # --distill loss: the head's input states, for its divergence
        with amp:  # --precision's autocast around the forwards only (log-probs, losses, backward: fp32)
            new_logprobs, new_entropy, _ = policy_logprobs(policy, qr, am, P, args.temperature,
                                                           args.ent_coef > 0 or fill, keep, args.logprob_chunk, states)
        if fill:  # (b, t) each: detached, as phase 3's no-grad pass would have given them, on every response token
            rollout.entropy[idx, :t] = new_entropy.detach() * rollout.mask[idx, :t]
            if args.old_logprobs == "on-policy":  # one epoch, one minibatch: nothing stepped since the sampler drew
                rollout.logprobs[idx, :t] = new_logprobs.detach() * rollout.mask[idx, :t]
        old_logprobs = rollout.logprobs[idx, :t]  # (b, t)
        new_logprobs = torch.where(mc_mask.bool(), new_logprobs, old_logprobs)  # (b, t): padding: ratio 1, no NaN
        pg_losses, ratio, logratio, pg_clipped = policy_objective(
            new_logprobs, old_logprobs, rollout.advantages[idx, :t], mc_mask, args)  # (b, t) each
        agg = loss_weights(mc_mask, mask[idx].sum(1), mb_tokens, mb_seqs, args.loss_agg,
                           args.max_episode_tokens)  # (b, t)
        pg_weights = agg * rollout.is_weights[idx, :t] if args.rollout_correction else agg  # (b, t)
        loss = (pg_losses * pg_weights).sum()
        if args.ent_coef > 0:
            loss = loss - args.ent_coef * (new_entropy * agg).sum()
        if args.kl_in_loss and not no_reference(args):  # GRPO style: the KL to the reference, a loss term
            kl = kl_penalty(new_logprobs, rollout.ref_logprobs[idx, :t], args.kl_estimator)  # (b, t)
            loss = loss + rollout.kl_coef * (kl * agg).sum()
        divergence = torch.zeros_like(mc_mask)  # (b, t): --distill loss's, to the teacher, over the full vocabulary
        if teacher is not None:  # the policy's head and the teacher's, a chunk of the tokens in the loss at a time
            with amp:
                with torch.no_grad():
                    teacher_states = head_states(teacher, qr, am, P)  # (b*t, H_teacher), its head, its cap
                divergence = distill_divergence(states, teacher_states, agg, args.temperature, args.distill_beta,
                                                args.logprob_chunk)  # (b, t)
            loss = loss + args.distill_coef * (divergence * agg).sum()
        vf_losses = vf_clipped = torch.zeros_like(mc_mask)  # (b, t): critic-free estimators have no critic
        if critic is not None:
            with amp:
                new_values = state_values(critic, qr, am, P)[:, :t]  # (b, t)
            vf_losses, vf_clipped = value_loss(new_values, rollout.values[idx, :t], rollout.returns[idx, :t],
                                               args.value_clip_eps)  # (b, t) each
            loss = loss + args.vf_coef * (vf_losses * mc_mask).sum() / mb_tokens
        (loss * world if scaler is None else scaler.scale(loss * world)).backward()  # (fp16: the loss scaled)
        with torch.no_grad():
            ratio_dev = (ratio - 1).abs() * mc_mask  # (b, t); on-policy it is 0: the check reads the sampler's
            if fill and args.old_logprobs == "on-policy":  # (as --old-logprobs sampler's ratio does)
                ratio_dev = (torch.exp(new_logprobs - rollout.engine_logprobs[idx, :t]) - 1).abs() * mc_mask
            stats["ratio_dev_max"] = max(stats["ratio_dev_max"], ratio_dev.max().item())
            for k, v in (("pg_loss", pg_losses), ("vf_loss", vf_losses), ("pg_clip", pg_clipped),
                         ("vf_clip", vf_clipped), ("approxkl", 0.5 * logratio ** 2), ("ratio", ratio),
                         ("ratio_dev", ratio_dev), ("tokens", torch.ones_like(ratio)), ("distill", divergence)):
                stats[k] += (v * mc_mask).sum().item()
    return stats


def ratio_health(update, mb_stats, ratio_dev_max, tol, device):
    """Phase 8, the first minibatch before its step: a mean |ratio - 1| (all ranks) above `tol` stops the run."""
    dev_sum, dev_tokens = global_sum(torch.tensor([mb_stats["ratio_dev"], mb_stats["tokens"]], device=device)).tolist()
    health = {"ppo/policy/ratio_at_start": dev_sum / max(dev_tokens, 1),
              "ppo/policy/ratio_max_at_start": global_max(ratio_dev_max, device)}  # the largest token's too
    if not math.isfinite(health["ppo/policy/ratio_at_start"]):  # (NaN > tol is False: it needs its own test)
        fail(f"update {update}: the importance ratio is not finite before any step: the old or the new log-probs "
             "hold NaN or inf (non-finite weights, or a sampled token outside the support they are taken on)")
    if health["ppo/policy/ratio_at_start"] > tol:
        fail(f"update {update}: mean |ratio - 1| = {health['ppo/policy/ratio_at_start']:.2e} before any step "
             f"(tolerance {tol:g}); the rollout and training passes disagree: dropout on, padding or position ids "
             "differ, temperature differs, or the generator's weights are stale")
    return health


def optimizer_step(models, optimizers, max_grad_norm, scaler=None):
    """Clip each model's gradient norm and step `optimizers`, unless a norm is not finite. Returns (stepped, norms)."""
    for opt in optimizers if scaler else ():  # fp16: the gradients unscaled before the clip
        scaler.unscale_(opt)
    norms = [torch.nn.utils.clip_grad_norm_(m.parameters(), max_grad_norm or math.inf) for m in models]
    norms = [float(n.full_tensor() if hasattr(n, "full_tensor") else n) for n in norms]  # FSDP2: DTensor
    finite = all(map(math.isfinite, norms))
    for opt in optimizers if finite else ():
        opt.step()
    if scaler:  # an overflow (the step skipped) halves the scale; 2,000 steps without one double it
        scaler.update()
    for m in models:
        m.zero_grad(set_to_none=True)
    return finite, norms


def gspo_loss(new_logprobs, old_logprobs, advantages, mask, clip_eps, clip_eps_high):
    """GSPO: PPO's clip on each response's ratio s, in veRL's token form s_t = sg(s) p_t / sg(p_t); as `policy_loss`."""
    logratio = new_logprobs - old_logprobs  # (b, t)
    seq_logratio = (logratio * mask).sum(1) / mask.sum(1).clamp(min=1)  # (b,): log s, over the agent's tokens
    log_s = new_logprobs - new_logprobs.detach() + seq_logratio.detach()[:, None]  # (b, t): value log s, token grad
    ratio = torch.exp(log_s.clamp(max=10.0))  # (b, t): veRL's bound against overflow
    pg_losses = -advantages * ratio  # (b, t)
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps_high)  # (b, t)
    clipped = pg_losses2 > pg_losses  # (b, t): whole responses, counted on each of their tokens (as veRL)
    return torch.max(pg_losses, pg_losses2), ratio, logratio, clipped.float()


def cispo_loss(new_logprobs, old_logprobs, advantages, cap):
    """CISPO: -sg(min(r, cap)) A log p per token: the weight is clipped, not the update. Returns as `policy_loss`."""
    logratio = (new_logprobs - old_logprobs).clamp(-20.0, 20.0)  # (b, t): veRL's bound against overflow
    ratio = torch.exp(logratio)  # (b, t)
    weight = ratio.clamp(max=cap).detach()  # (b, t): no gradient through the weight
    clipped = ratio > cap  # (b, t): where the weight was capped (veRL: ratio != clipped ratio)
    return -weight * advantages * new_logprobs, ratio, logratio, clipped.float()


def policy_objective(new_logprobs, old_logprobs, advantages, mask, args):
    """--policy-loss's per-token losses (b, t), with the ratio, log-ratio and clipped indicator of each token."""
    if args.policy_loss == "gspo":  # one ratio per response (Zheng et al. 2025)
        return gspo_loss(new_logprobs, old_logprobs, advantages, mask, args.clip_eps, args.clip_eps_high)
    if args.policy_loss == "cispo":  # the clipped weight, detached, times log p (MiniMax-M1)
        return cispo_loss(new_logprobs, old_logprobs, advantages, args.cispo_cap)
    if args.policy_loss == "ppo":
        return policy_loss(new_logprobs, old_logprobs, advantages, args.clip_eps, args.clip_eps_high, args.dual_clip)
    fail(f"--policy-loss {args.policy_loss!r} has no branch in policy_objective (ppo, gspo, cispo)")


def distill_divergence(states, teacher_states, weights, temperature, beta, chunk):
    """--distill loss's generalized JSD per position (b, t), 0 where `weights` are: each model's head on `chunk`
    positions at a time, and each chunk's (chunk, V) logits rebuilt in the backward rather than kept (memory flat in
    the vocabulary, as `HeadLogprobs`; TRL 1.12's _chunked_divergence_loss checkpoints its chunks the same way)."""
    (hidden, head, cap), (teacher_hidden, teacher_head, teacher_cap) = states, teacher_states  # (b*t, H) and its own
    rows = weights.flatten().nonzero().squeeze(1)  # (n,): the positions in the loss
    fp32 = getattr(head, "fp32", False)  # --fp32-head: the policy's head outside autocast, as in `chunked_logprobs`

    def heads(h, th):  # (n, H), (n, H_teacher) -> (n,)
        with torch.autocast(h.device.type, enabled=False) if fp32 else contextlib.nullcontext():
            s = head_logits(h, head.weight, head.bias, temperature, cap)  # (n, V)
        return generalized_jsd(s, head_logits(th, teacher_head.weight, teacher_head.bias, temperature, teacher_cap),
                               beta)
    parts = [torch.utils.checkpoint.checkpoint(heads, hidden[r], teacher_hidden[r], use_reentrant=False)
             for r in rows.split(chunk)]
    return torch.zeros(weights.numel(), device=weights.device).index_put((rows,), torch.cat(parts)).view_as(weights)


def generalized_jsd(s, t, beta):
    """Agarwal et al. 2024's generalized JSD of the policy's and the teacher's logits (n, V) each, per row:
    beta KL(p_t || m) + (1 - beta) KL(p_s || m), m = beta p_t + (1 - beta) p_s; beta 0 is the forward KL
    KL(p_t || p_s), 1 the reverse KL(p_s || p_t), as TRL 1.12 defines them (its `beta`)."""
    log_s, log_t = torch.log_softmax(s, -1), torch.log_softmax(t, -1)  # (n, V) each
    kl = lambda log_p, log_q: (log_p.exp() * (log_p - log_q)).sum(-1)  # (n,): KL(p || q)
    if beta in (0.0, 1.0):  # (m is one of the two: no log 0)
        return kl(log_t, log_s) if beta == 0.0 else kl(log_s, log_t)
    log_m = torch.logaddexp(log_t + math.log(beta), log_s + math.log1p(-beta))  # (n, V)
    return beta * kl(log_t, log_m) + (1 - beta) * kl(log_s, log_m)  # (n,)


def ptx_loss(policy, tokenizer, ptx_ids, rows, device, amp, key):
    """PPO-ptx (InstructGPT): the language-modelling loss of `rows` texts drawn from the supervised set (this rank's
    share of the rows drawn by `key`), a mean over every rank's tokens: the same loss on any number of ranks."""
    rank, world = rank_and_world()
    drawn = np.random.default_rng(key).integers(len(ptx_ids), size=rows * world)[rank * rows: (rank + 1) * rows]
    batch = tokenizer.pad({"input_ids": [ptx_ids[i] for i in drawn]},
                          padding_side="right", return_tensors="pt").to(device)
    labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)  # (b, L): no loss on padding
    tokens = global_sum((labels[:, 1:] != -100).sum()).clamp(min=1)  # the tokens predicted, on all ranks
    with amp:  # (times world: FSDP averages the gradients over ranks)
        return policy(**batch, labels=labels, num_items_in_batch=tokens).loss * world


# ==============================================================================================
# main: setup, the loop, teardown
# ==============================================================================================

def main(args: Args):
    rank, world, device = init_distributed()
    log = print if rank == 0 else (lambda *a, **k: None)
    local_batch, num_updates = check_args(args, world)  # rollouts of this rank per update; updates in all
    run_name, run_dir, resume_dir = find_run(args, rank, world, log)
    seed_everything(args.seed)  # (every rank alike: a row's random draws are keyed by its place, see `row_keys`)
    models = load_models(args, device, log)
    shard_models(models, args, device, world)  # FSDP2 under torchrun, frozen models frozen (and offloaded)
    tokenizer, policy, ref_policy, critic = models.tokenizer, models.policy, models.ref_policy, models.critic
    teacher, distiller = (models.teacher, None) if args.distill == "reward" else (None, models.teacher)  # phase 3 or 7
    trained = [m for m in (policy, critic) if m is not None]  # the models with optimizers
    policy.generation_config = GenerationConfig(  # a clean sampler: a checkpoint's may carry top-k 20, penalties...
        do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        max_new_tokens=args.response_length, eos_token_id=models.stop_ids, pad_token_id=tokenizer.pad_token_id)
    engine_sleeps = args.vllm and args.vllm_sleep and device.type == "cuda"  # CPU builds have no sleep mode
    prompt_rows, prompt_ids, eval_rows, eval_ids, ptx_ids = load_prompts(args, tokenizer, log, models.env)
    rates = {"policy": args.learning_rate, "critic": args.critic_learning_rate}
    optimizers = [adamw([p for p in m.parameters() if p.requires_grad], rates[name], args.fused_adamw, name, log)
                  for m, name in zip(trained, rates)]  # (LoRA: the adapters and the value head alone)
    decay = (lambda u: 1.0 - u / num_updates) if args.anneal_lr else (lambda u: 1.0)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, decay) for opt in optimizers]
    amp = forward_autocast(args, device)  # around every forward (nanoGPT's)
    scaler = torch.amp.GradScaler(device.type) if args.precision == "fp16" else None  # (Micikevicius et al. 2018)
    kl_coef, first_update, best, drawn = (args.kl_coef, 1, -math.inf, None) if resume_dir is None else restore(
        resume_dir, models, optimizers, schedulers, scaler, args.keep_best)  # the state the loop changes
    llm = start_vllm(args, models, device)  # None without --vllm (fed the resumed weights)
    sampler = Sampler(policy, tokenizer, args, device, drawn) if args.async_steps else None  # (see inside)
    metrics_file = open_run(args, run_name, run_dir, first_update)  # rank 0's metrics.jsonl, else None
    sampler_filter = (args.top_k, args.top_p) if args.keep_sampling_mask else None
    mb_rows = local_batch // args.num_minibatches  # rows of one minibatch on this rank
    micro = args.micro_batch_size or mb_rows  # rows of one forward
    nonfinite_streak, stop = 0, False
    catch_stop_signals(run_name)  # SIGTERM (preemption) and Ctrl-C: finish the update, checkpoint it, stop
    log(f"run {run_name}: {num_updates} updates of {args.batch_size} rollouts on {world} rank(s) -> {run_dir}/")
    t_start = time.perf_counter()
    bar = tqdm(range(first_update, num_updates + 1), desc="ppo", unit="update", dynamic_ncols=True,  # (in a log,
               initial=first_update - 1, total=num_updates, disable=rank != 0 or not sys.stderr.isatty())  # no bar)
    for update in bar:
        t0, cpu0 = time.perf_counter(), time.process_time()  # wall clock, and this process's CPU seconds
        # 1. sample prompts (each pass over the prompt set in a fresh order) and generate (--env: play episodes);
        # 2. cut each response after its first EOS: the mask keeps the EOS (both in `generate`); and the score
        batch_idx = prompt_order(update, len(prompt_rows), args, rank, local_batch)  # (B,)
        drawn = sampler and sampler.take(update, policy, prompt_ids, last=update == num_updates)  # --async-steps
        batch = sample(models, args, prompt_rows, prompt_ids, batch_idx, row_keys(args, update, 0, rank, local_batch,
                       args.group_size), micro, amp, device, llm, drawn=drawn,
                       keys=row_keys(args, update, 1, rank, local_batch))  # each row's random stream
        sampling = {}  # --dynamic-sampling's metrics
        if args.dynamic_sampling:  # DAPO: a group whose samples all scored the same has no signal; refill (see inside)
            batch, sampling = dynamic_sampling(batch, update, models, args, prompt_rows, prompt_ids, micro, amp,
                                               device, llm)
        (batch_rows, query_responses, attention_mask, lengths, has_eos, mask, P, engine_logprobs, turn_rewards,
         turn_ends, texts, scores, score_parts) = batch  # (B, ...): see `Sampled`
        t_generate = time.perf_counter() - t0

        # 3. no-grad passes: old (unless --old-logprobs skips them) and reference log-probs, values (score: in `sample`)
        move(models.swapped, device)
        with amp:
            logprobs, ref_logprobs, entropy, values, next_values, support, teacher_logprobs = rollout_passes(
                policy if args.old_logprobs == "recompute" else None, ref_policy, critic, query_responses,
                attention_mask, mask, P, micro, args.temperature, sampler_filter, args.logprob_chunk,
                args.micro_batch_tokens, teacher)  # (B, T) each; next_values (B,); teacher_logprobs None or (B, T)
        move([m for m in models.swapped if m is not distiller], "cpu")  # free the accelerator for phase 7
        if args.old_logprobs == "sampler":  # veRL's bypass mode: the ratio is then against the sampler itself
            logprobs = engine_logprobs * mask  # (B, T): 0 on observations (never a sampler's value there)

        # 4. per-token rewards: KL penalty everywhere, the score on the last real token (long responses: see inside)
        scores, bootstrap_value = long_responses(scores, has_eos, lengths, next_values, args)  # (B,), (B,) or None
        kl = 0 * mask if ref_policy is None else kl_penalty(logprobs, ref_logprobs, args.kl_estimator) * mask  # (B, T)
        distill = 0.0 if teacher_logprobs is None else args.distill_coef * (logprobs - teacher_logprobs) * mask  # k1
        rewards, non_score_reward = per_token_rewards(kl, scores, lengths, 0.0 if args.kl_in_loss else kl_coef,
                                                      turn_rewards, distill)  # (B, T) each
        if args.whiten_rewards:
            rewards = masked_whiten(rewards, mask, shift_mean=False)  # (B, T)

        # 5. advantages: GAE with the critic's values (see inside), or each response's total reward against its group
        if ESTIMATORS[args.adv_estimator]["critic"]:
            advantages, returns = gae_advantages(rewards, values, mask, bootstrap_value, turn_ends, args)  # (B, T) each
        else:  # critic-free: the values are 0, and `returns` (the lambda-return) is only logged
            returns = compute_gae_over_actions(rewards, values, mask, args.gamma, args.lam)[1]  # (B, T)
            seq_adv = group_advantages(rewards.sum(1), args.group_size, args.adv_estimator, args.group_std)  # (B,)
            advantages = seq_adv[:, None] * mask  # (B, T): the response's advantage on each of its tokens

        # 6. whiten advantages over the tokens in the loss (padding re-zeroed inside); GAE only by default
        if args.whiten_advantages:
            in_loss = mask * has_eos[:, None] if args.overlong_filter else mask  # (B, T): DAPO drops the cut ones
            advantages = masked_whiten(advantages, in_loss)  # (B, T)
        t_rollout = time.perf_counter() - t0

        # 7. K epochs over the fixed batch: minibatches, each accumulated over micro-batches
        t1 = time.perf_counter()
        rollout = Rollout(query_responses, attention_mask, lengths, mask, has_eos, logprobs, ref_logprobs, entropy,
                          support, values, scores, kl, non_score_reward, rewards, advantages, returns, kl_coef,
                          turn_ends=turn_ends, engine_logprobs=engine_logprobs, teacher_logprobs=teacher_logprobs)
        if args.rollout_correction:  # the sampler's gap, weighted or masked in the losses (see inside)
            rollout.is_weights, rollout.kept, rollout.corrected = rollout_correction(
                logprobs, engine_logprobs, mask, args.rollout_correction, args.rollout_correction_low,
                args.rollout_correction_high)  # (B, T) each
        if engine_sleeps:
            llm.sleep(level=2)  # weights and KV cache freed for the epochs; phase 9 refills the weights
        stats, epoch_clipfrac, health, skipped_steps, early_stop = {}, [], None, 0, False
        for model in trained:  # HF recomputes activations only in training mode (dropout stays off)
            model.train(args.gradient_checkpointing)
        stepping = optimizers if update > args.critic_warmup_updates else optimizers[1:]  # warm-up: critic only
        for epoch in range(args.num_ppo_epochs):
            perm = minibatch_order(args, update, epoch, len(lengths)).to(device)  # (B,)
            epoch_stats = {}
            for mb_start in range(0, len(lengths), mb_rows):
                mb_stats = minibatch_backward(policy, critic, rollout, perm[mb_start: mb_start + mb_rows], P, args, amp,
                                              scaler, first=epoch == 0, teacher=distiller)
                ratio_dev_max = mb_stats.pop("ratio_dev_max")
                if health is None:  # 8. health check: the first minibatch, before the first step (see inside)
                    health = ratio_health(update, mb_stats, ratio_dev_max, args.ratio_check_tol, device)
                if args.ptx_coef > 0:  # PPO-ptx (InstructGPT): a language-modelling loss keeps the SFT skills
                    ptx = args.ptx_coef * ptx_loss(policy, tokenizer, ptx_ids, mb_rows, device, amp,
                                                   [args.seed, STREAMS["ptx"], update, epoch, mb_start // mb_rows])
                    (ptx if scaler is None else scaler.scale(ptx)).backward()
                finite, _ = optimizer_step(trained, stepping, args.max_grad_norm, scaler)
                # a NaN loss gives NaN gradients (fp16: counted once the loss scale is down to 1)
                nonfinite_streak = 0 if finite or (scaler and scaler.get_scale() > 1) else nonfinite_streak + 1
                skipped_steps += not finite
                if nonfinite_streak >= args.max_nonfinite_steps:
                    fail(f"update {update}: {nonfinite_streak} optimizer steps in a row had a non-finite loss or "
                         "gradient; lower the learning rates, check the reward for inf/NaN, or use fp32")
                for k, v in mb_stats.items():
                    epoch_stats[k] = epoch_stats.get(k, 0.0) + v
                if args.target_kl is not None:  # CleanRL's early stop, on this minibatch's approx-KL (all ranks)
                    mb_kl, mb_n = global_sum(torch.tensor([mb_stats["approxkl"], mb_stats["tokens"]],
                                                          device=device)).tolist()
                    early_stop = mb_kl / mb_n > args.target_kl
                if early_stop:
                    break
            epoch_clipfrac.append(epoch_stats["pg_clip"] / max(epoch_stats["tokens"], 1))
            for k, v in epoch_stats.items():
                stats[k] = stats.get(k, 0.0) + v
            if early_stop:
                break
        for model in trained:
            model.eval()
        move(models.swapped, "cpu")  # (--distill loss: the teacher, there for phase 7 too)
        for sched in schedulers:
            sched.step()
        kl_coef = adaptive_kl_coef(kl_coef, kl, args)  # with --kl-target (Ziegler et al. 2019), else unchanged
        t_update = time.perf_counter() - t1

        # 9. push the new weights into the vLLM engine before it samples again
        t_push = time.perf_counter()
        if args.vllm:
            push_weights(llm, policy, wake=engine_sleeps)
        t_push = time.perf_counter() - t_push

        # 10. log, save
        t_log = time.perf_counter()
        times = {"time/rollout_s": t_rollout, "time/push_s": t_push, "time/generate_s": t_generate,
                 "time/update_s": t_update, "time/cpu_s": time.process_time() - cpu0,
                 **({"time/sampler_s": sampler.seconds} if sampler else {})}  # (generate_s: the wait for it)
        row = metrics_row(update, args, rollout, stats, epoch_clipfrac, health, skipped_steps, kl_coef,
                          schedulers[0].get_last_lr()[0], times, score_parts, models.gold, tokenizer)
        row.update(sampling)  # --dynamic-sampling: its time/generated_tokens counts every round's
        row.update({"ppo/loss_scale": scaler.get_scale()} if scaler else {})  # fp16
        eval_samples = []
        if args.eval_every and (update % args.eval_every == 0 or update == num_updates):
            t_eval = time.perf_counter()
            eval_row, eval_samples = evaluate(update, args, models, eval_rows, eval_ids, local_batch, micro, amp,
                                              device, llm)
            row.update(eval_row)
            t_log += time.perf_counter() - t_eval
        row = reduce_row(row, device)  # under torchrun: one value for all ranks
        if args.keep_best and keep_best_value(row, args) > best:
            best = row[args.keep_best]
            save_models(os.path.join(run_dir, "best"), models)
            if rank == 0:  # which update it is: a resume of an earlier step drops a best of the abandoned branch
                write_json(os.path.join(run_dir, "best", "best.json"), {"step": update, args.keep_best: best})
        if rank == 0:  # the rows reach the disk before the checkpoint: resuming from step k finds rows 1..k
            row["time/log_s"] = time.perf_counter() - t_log  # phase 10 up to here, evaluation excluded
            samples = []
            if args.sample_every and (update % args.sample_every == 0 or update == num_updates):
                firsts = tokenizer.batch_decode(query_responses[:4, :P], skip_special_tokens=True)  # (--env's prompts)
                samples = [{"step": update, "prompt": r["prompt"] if models.env is None else first, "response": text,
                            "score": s} for r, first, text, s in zip(batch_rows, firsts, texts, scores.tolist())]
            write_logs(args, run_dir, metrics_file, bar, row, samples, eval_samples)
        stop = global_max(float(bool(STOP_SIGNALS)), device) > 0  # SIGTERM or Ctrl-C on any rank: all stop here
        if (args.save_every and update % args.save_every == 0) or stop:
            save_checkpoint(args, run_dir, update, models, optimizers, schedulers, scaler, kl_coef, best, device,
                            sampler and sampler.wait())  # --async-steps: the batch drawn ahead is saved too
        if stop:
            break

    if not stop:  # a stopped run keeps its checkpoint; the final models are for a finished one
        save_models(run_dir, models)
        if rank == 0:
            log(run_summary(args, run_dir, time.perf_counter() - t_start))
    close_run(args, metrics_file, run_dir)
    teardown(llm, world, sampler)
    if stop:
        raise stopped(update, run_name, run_dir)


# ==============================================================================================
# Plumbing, read when you need it
# ==============================================================================================

# --- checks and errors ------------------------------------------------------------------------
class UsageError(Exception):
    """Bad input: printed as one line (what is wrong, what to do) with exit status 2."""


class Stopped(Exception):
    """Stopped by a signal: printed as one line (where the run stands, how to continue), exit status 128 + signal."""
    def __init__(self, code, msg):
        super().__init__(msg)
        self.code = code


STOP_SIGNALS = []  # the stop signals received during the loop
PREVIOUS_HANDLERS = {}


def catch_stop_signals(run_name):
    """SIGTERM (preemption) and Ctrl-C end the loop after the update in flight, checkpointed; a 2nd Ctrl-C at once."""
    STOP_SIGNALS.clear()

    def handler(signum, frame):
        if STOP_SIGNALS and signum == signal.SIGINT:
            raise Stopped(130, f"interrupted again, at once: continue from the newest checkpoint with the same flags "
                               f"and --run-name {run_name} --resume auto")
        STOP_SIGNALS.append(signum)
        print(f"\n{signal.Signals(signum).name}: finishing this update, then a checkpoint, then stopping "
              "(Ctrl-C again stops at once)", file=sys.stderr, flush=True)
    for s in (signal.SIGTERM, signal.SIGINT):
        PREVIOUS_HANDLERS[s] = signal.signal(s, handler)


def stopped(update, run_name, run_dir):
    signum = STOP_SIGNALS[0] if STOP_SIGNALS else signal.SIGTERM  # the signal may have reached another rank
    return Stopped(128 + signum, f"{signal.Signals(signum).name} after update {update}: its checkpoint is {run_dir}/"
                   f"checkpoints/step_{update}; continue with the same flags and --run-name {run_name} --resume auto")


def fail(msg):
    raise UsageError(msg)


def reason(e):
    """The first line of an exception's message, or its type when it has none."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


WORLDS = ("toy", "chain", "guess")  # --model names of the built-in worlds (toy.py, chain.py, guess.py)
RESERVED_RUN_NAMES = (*WORLDS, "smollm2")  # runs/<name>/ of the built-in worlds


def open_or_empty(path):
    return open(path).read() if os.path.exists(path) else ""


def check_args(args, world):
    """Every check that reads only the flags and the world size; returns a rank's rollouts per update, the updates."""
    env = args.env or args.model == "guess" or args.tools  # (the guess world brings its env; tools.py is one)
    if args.tools and (args.env or args.model == "guess" or not args.reward_fn):
        fail("--tools plays episodes of its own, scored by --reward-fn on the last answer: no --env; add --reward-fn")
    if args.max_turns is not None and args.max_turns > 1 and not env:
        fail(f"--max-turns {args.max_turns} needs --env: without an environment nothing answers between turns")
    if args.max_episode_tokens is not None and not env:
        fail("--max-episode-tokens needs --env (a single response's limit is --response-length)")
    if env and (args.reward_fn and not args.tools or args.reward_model):
        fail("--env gives the rewards: --reward-fn and --reward-model with it are not supported yet")
    if args.policy_loss == "cispo" and (args.clip_eps is not None or args.clip_eps_high is not None):
        fail("--policy-loss cispo clips the importance weight, at --cispo-cap; --clip-eps(-high) do nothing with it")
    if args.adv_estimator not in ESTIMATORS:  # (tyro refuses other names; ppo.Args(...) from Python does not)
        fail(f"--adv-estimator {args.adv_estimator!r} is not one of {', '.join(ESTIMATORS)}")
    args.fill_defaults(world)
    one = torch.ones(1, 1)  # a name that no branch reads (a fork's typo) fails here, before any model loads
    kl_penalty(one, one, args.kl_estimator), loss_weights(one, one[0], 1, 1, args.loss_agg, 1)
    policy_objective(one, one, one, one, args)
    if args.rollout_correction:
        rollout_correction(one, one, one, args.rollout_correction, args.rollout_correction_low, 2.0)
    if (args.dataset_options is not None or args.answer_format != "tag") and not (args.dataset or "").startswith(
            "reasoning-gym:"):
        fail("--dataset-options and --answer-format are for --dataset reasoning-gym:NAME")
    if args.policy_loss != "ppo" and args.dual_clip is not None:
        fail(f"--dual-clip is PPO's (it caps the token surrogate); --policy-loss {args.policy_loss} has none")
    if args.kl_in_loss and args.kl_estimator == "k1":
        fail("--kl-in-loss with --kl-estimator k1 does not regularise: its gradient is that of log p, with no "
             "reference in it (Tang and Munos 2025); use k2 (the reverse KL's gradient), k3 (GRPO's) or abs")
    critic = ESTIMATORS[args.adv_estimator]["critic"]
    if not critic and (args.bootstrap_truncated or args.critic_lam is not None or args.lam_alpha is not None
                       or not args.gae_across_observations or args.critic_warmup_updates):
        fail(f"--bootstrap-truncated, --critic-lam, --lam-alpha, --no-gae-across-observations and "
             f"--critic-warmup-updates need a critic: --adv-estimator {args.adv_estimator} has none (use gae)")
    if args.lora_rank and args.ref_model:
        fail("--ref-model with --lora-rank: the reference is the policy's base with its adapters off; drop one")
    if (args.distill_coef != 1.0 or args.distill == "loss") and not args.teacher:
        fail("--distill-coef and --distill loss are the teacher's term: add --teacher PATH, or drop them")
    if args.distill_beta != 1.0 and args.distill != "loss" or not 0 <= args.distill_beta <= 1:
        fail(f"--distill-beta {args.distill_beta}: the divergence of --distill loss, between 0 and 1")
    if args.ref_model and no_reference(args):
        fail("--ref-model at --kl-coef 0: no KL reads a reference, so none is loaded; add --unread-reference to load "
             "and run it anyway (its KL logged), or drop --ref-model")
    bf16_forwards = args.precision == "bf16" or (args.precision == "auto" and torch.cuda.is_available())
    if args.precision == "fp16" and world > 1:
        fail("--precision fp16 under torchrun is not written (each rank would scale by its own overflows): use bf16")
    if args.lora_base_dtype == "bf16" and not (args.lora_rank and bf16_forwards and world == 1):
        fail("--lora-base-dtype bf16 needs --lora-rank, forwards in bf16 (--precision bf16) and one process (FSDP2 "
             "shards one dtype per layer): use --lora-base-dtype fp32")
    if args.lora_rank and args.critic_init == "scratch":
        fail("--critic-init scratch with --lora-rank: adapters on a frozen random base learn little; start the "
             "critic from the policy or the reward model")
    sampler_filter = args.top_p != 1.0 or args.top_k != 0
    if sampler_filter and not args.keep_sampling_mask:
        fail("--top-p/--top-k make the sampled support differ from the softmax the trainer scores "
             "(unbounded ratios): add --keep-sampling-mask, or use temperature only")
    if sampler_filter and args.vllm:
        fail("--top-p/--top-k with --vllm are not supported yet: the sampling mask is taken from HF's own filters")
    if not (args.response_length > 0 and args.max_prompt_length > 0):
        fail("--response-length and --max-prompt-length must be positive")
    if not (args.lora_rank >= 0 and args.lora_alpha > 0):
        fail("--lora-rank must be >= 0 (0: off) and --lora-alpha > 0")
    for what, ok, names in (  # every flag with a range, None passing where a flag may be None (NaN fails each test)
            ("> 0: log-probs are taken from logits / tau", lambda x: 0 < x < math.inf, "temperature"),
            ("positive", lambda x: x > 0, "max_turns max_episode_tokens "
             "total_episodes batch_size num_minibatches num_ppo_epochs group_size micro_batch_size micro_batch_tokens "
             "eval_size eval_samples kl_horizon target_kl kl_target lam_alpha value_clip_eps clip_eps_high "
             "keep_checkpoints max_nonfinite_steps ratio_check_tol rollout_correction_high"),
            (">= 0", lambda x: x >= 0, "kl_coef distill_coef vf_coef ent_coef ptx_coef max_grad_norm "
             "critic_warmup_updates top_k sample_every eval_every save_every dynamic_sampling_rounds "
             "rollout_correction_low"),
            ("finite", math.isfinite, "kl_coef kl_target pass_threshold missing_eos_penalty "
             "reward_model_weight reward_fn_weight"),
            ("in [0, 1]", lambda x: 0 <= x <= 1, "gamma lam critic_lam"),
            ("in (0, 1]", lambda x: 0 < x <= 1, "learning_rate critic_learning_rate top_p vllm_gpu_memory_utilization"),
            ("in (0, 1)", lambda x: 0 < x < 1, "clip_eps"), ("in [0, 1)", lambda x: 0 <= x < 1, "eval_fraction"),
            ("in [0, 2**32)", lambda x: 0 <= x < 2**32, "seed"),
            (">= 1: a lower cap shrinks the weight of on-policy tokens", lambda x: x >= 1, "cispo_cap"),
            ("> 1 (Ye et al. 2020 use 3)", lambda x: x > 1, "dual_clip")):
        for name in names.split():
            if getattr(args, name) is not None and not ok(getattr(args, name)):
                fail(f"--{name.replace('_', '-')} must be {what} (it is {getattr(args, name)})")
    if args.micro_batch_size is not None and args.micro_batch_tokens is not None:
        fail("--micro-batch-size and --micro-batch-tokens are two ways to split a minibatch: pass one")
    if args.eval_samples > 1 and args.eval_greedy:
        fail("--eval-greedy with --eval-samples > 1: greedy responses are all the same, pass@k would be pass@1; sample "
             "at --temperature, or pass --eval-samples 1")
    if args.overlong_buffer is not None and not 0 < args.overlong_buffer <= args.max_episode_tokens:
        fail("--overlong-buffer must be in [1, --response-length] (with --env: [1, --max-episode-tokens])")
    if (args.keep_best or "").startswith("eval/") and not args.eval_every:
        fail("--keep-best eval/... needs --eval-every N: nothing is evaluated without it")
    if args.run_name is not None and (not re.fullmatch(r"\w[\w.+-]*", args.run_name) or
                                      args.run_name in RESERVED_RUN_NAMES):
        fail(f"--run-name {args.run_name!r} must be a plain name (letters, digits, _ . + -), not a path, and not "
             f"one of {', '.join(RESERVED_RUN_NAMES)} (built-in worlds live there)")
    if args.track and not (os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE") in ("offline", "disabled")
                           or "api.wandb.ai" in open_or_empty(os.path.expanduser("~/.netrc"))):
        fail("--track needs wandb credentials: run `wandb login`, set WANDB_API_KEY, or set WANDB_MODE=offline")
    if args.bootstrap_truncated and args.missing_eos_penalty is not None:
        fail("--bootstrap-truncated replaces the missing-EOS penalty: also pass --missing-eos-penalty None")
    if args.batch_size % (world * args.num_minibatches * (args.micro_batch_size or 1)) != 0:
        fail(f"--batch-size {args.batch_size} must split into {world} rank(s) x --num-minibatches "
             f"{args.num_minibatches} x micro-batches of --micro-batch-size {args.micro_batch_size}")
    local_batch, groups = args.batch_size // world, ESTIMATORS[args.adv_estimator]["groups"]
    if args.dynamic_sampling and not groups:
        fail("--dynamic-sampling drops the groups of samples that all scored the same, a zero group advantage: it "
             "needs --adv-estimator grpo or rloo (with GAE the critic's baseline still gives such responses a signal)")
    if local_batch % args.group_size or (groups and args.group_size < 2):
        fail(f"--group-size {args.group_size} must divide a rank's {local_batch} rollouts, and be >= 2 for "
             f"--adv-estimator {args.adv_estimator} (it compares the samples of one prompt)")
    num_updates = args.total_episodes // args.batch_size
    if num_updates < 1:
        fail(f"--total-episodes {args.total_episodes} is less than one batch of {args.batch_size}")
    if args.resume == "auto" and args.run_name is None:
        fail("--resume auto needs the --run-name of the run to continue")
    if args.old_logprobs == "on-policy" and ((args.num_ppo_epochs, args.num_minibatches, args.kl_coef) != (1, 1, 0)
                                             or args.unread_reference or args.teacher and args.distill == "reward"):
        fail("--old-logprobs on-policy needs 1 epoch, 1 minibatch, --kl-coef 0, no --unread-reference, no --teacher "
             "but --distill loss (phase 4 reads the old log-probs): use recompute")
    if args.old_logprobs != "recompute" and (args.keep_sampling_mask or args.rollout_correction):
        fail(f"--old-logprobs {args.old_logprobs} with --keep-sampling-mask or --rollout-correction: not written yet")
    if args.async_steps and (world > 1 or env or args.vllm or args.dynamic_sampling or args.lora_rank
                             or args.keep_sampling_mask or args.fp32_head):
        fail("--async-steps 1 with torchrun, --env (the guess world's too), --vllm, --dynamic-sampling, --lora-rank, "
             "--keep-sampling-mask or --fp32-head is not written yet: drop one")
    if args.rollout_correction and not (args.vllm or args.sampler_precision != "auto" or args.async_steps):
        fail("--rollout-correction corrects for a sampler apart from the trainer: add --vllm, --sampler-precision or "
             "--async-steps 1")
    if args.rollout_correction in ("token-is", "seq-is") and args.rollout_correction_low is not None:
        fail(f"--rollout-correction {args.rollout_correction} caps its weights at --rollout-correction-high and has no "
             "lower bound: drop --rollout-correction-low, or use icepop to zero the weights outside [low, high]")
    if (args.rollout_correction_low or 0) > (args.rollout_correction_high or math.inf):
        fail("--rollout-correction-low must be at most --rollout-correction-high")
    if args.ptx_coef > 0 and args.ptx_dataset is None and args.model not in WORLDS:
        fail("--ptx-coef needs --ptx-dataset, a file with a `text` column")
    return local_batch, num_updates


# --- distributed ------------------------------------------------------------------------------
def init_distributed():
    """Rank, world size and this rank's device; the process group under torchrun."""
    rank, world = 0, 1
    if "RANK" in os.environ:
        if torch.cuda.is_available():  # before NCCL and FSDP touch a GPU: each rank its own, not all cuda:0
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    transformers.utils.logging.disable_progress_bar()  # one progress bar: ours
    return rank, world, torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu")


def rank_and_world():
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def global_max(x, device):
    """The largest value of a float over all ranks (NCCL reduces GPU tensors only, hence the device)."""
    if rank_and_world()[1] == 1:
        return x
    x = torch.tensor(x, device=device)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x.item()


def shard(model, no_split, offload=False):
    """FSDP2 on each decoder layer, then the root (whose forward is the one called); offload: the shards on the CPU."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    for m in model.modules():
        if type(m).__name__ in no_split:
            fully_shard(m, offload_policy=policy)
    return fully_shard(model, offload_policy=policy)


def full_state_dict(model):
    """The whole state dict on every rank, on the CPU (FSDP2 keeps only a shard per rank)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    if not dist.is_initialized():
        return None  # save_pretrained reads the module itself
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def reduce_row(row, device):
    """One value for all ranks: the mean over their equal slices, or for a maximum the largest rank's."""
    if rank_and_world()[1] == 1:
        return row
    keys = [k for k in row if k not in ("step", "episode")]
    values = torch.tensor([float(row[k]) for k in keys], dtype=torch.float64, device=device)
    largest = values.clone()
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    is_max = torch.tensor([k.endswith(("_max", "peak_mb")) for k in keys], device=device)  # (keys,)
    row.update(zip(keys, torch.where(is_max, largest, global_sum(values) / dist.get_world_size()).tolist()))
    return row


def teardown(llm, world, sampler=None):
    if sampler is not None:
        sampler.close()
    if world > 1:  # no rank leaves while another works (a rank that did aborted at exit on CI: FSDP2 with gloo)
        dist.barrier()
    if llm is not None:  # the engine's teardown also destroys torch.distributed's default group
        llm.llm_engine.engine_core.shutdown()
    if world > 1 and dist.is_initialized():
        dist.destroy_process_group()


# --- models -----------------------------------------------------------------------------------
@dataclass
class Models:
    """The four models and what reads their inputs and outputs."""
    tokenizer: object  # the policy's, left-padding, with a pad token for batching
    shipped_tokenizer: object  # the policy's tokenizer as the checkpoint ships it, saved with the policy
    shipped_generation_config: object  # the checkpoint's own (its stop ids, its sampling defaults), saved likewise
    stop_ids: list  # the token ids that end a response, one set for the whole run
    policy: nn.Module
    ref_policy: nn.Module
    teacher: Optional[nn.Module]  # --teacher, frozen as the reference is; else None
    critic: Optional[nn.Module]  # a ValueModel; None for the critic-free estimators
    reward_model: Optional[nn.Module]  # a ValueModel; None when --reward-fn alone scores
    rm_tokenizer: object  # the reward model's own tokenizer; None when it reads the policy's tokens
    reward_fn: object  # --reward-fn, or None
    env: object  # --env's class, or None
    gold: object  # the toy world's hidden judge, or None
    policy_path: str  # the initial checkpoint (the vLLM engine is built from it)
    critic_path: str  # the critic's (LoRA: the base its adapters apply to)
    stored_dtypes: tuple  # the dtypes the policy's and the critic's checkpoints came in: the final models' too
    swapped: list  # frozen models moved onto the device for phase 3 only (--offload-frozen, unsharded)


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def disable_dropout(model):
    """Dropout off for good: nn.Dropout modules and the float `attention_dropout` HF attention reads."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0
    return model.eval()


def load_model(cls, path, flag, args, **kw):
    """An HF checkpoint as `cls` in fp32 (safetensors, no remote code unless asked), dropout off; or a clear error."""
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as e:
        fail(f"{flag} {path!r} cannot be loaded: {reason(e)}")
    archs = config.architectures or []
    if cls is AutoModelForCausalLM and archs and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        fail(f"{flag} {path!r} is a {archs[0]}, not a causal language model")
    if flag == "--reward-model" and (not any(a.endswith("ForSequenceClassification") for a in archs)
                                     or config.num_labels != 1):
        fail(f"--reward-model {path!r} must be a sequence classifier with one output (num_labels=1); "
             f"it is {archs[0] if archs else 'unknown'} with {config.num_labels} labels")
    # fp32 whatever the checkpoint is stored in: AdamW on bf16 weights rounds most small steps away (docs/precision.md)
    model = cls.from_pretrained(path, use_safetensors=True, trust_remote_code=args.trust_remote_code,
                                dtype=torch.float32, **kw)
    return disable_dropout(model)


def stored_dtype(path, args):
    """The dtype a checkpoint's config says its weights are stored in (fp32 if none, or if the checkpoint is gone)."""
    try:
        dtype = getattr(AutoConfig.from_pretrained(path, trust_remote_code=args.trust_remote_code), "dtype", None)
    except (OSError, ValueError):
        return torch.float32
    dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def load_tokenizer(path, flag, args, **kw):
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=args.trust_remote_code, **kw)
    except (OSError, ValueError) as e:
        fail(f"{flag} {path!r} cannot be loaded: {reason(e)}")


def load_models(args, device, log):
    """Tokenizers and the four models, dropout off, on the device, as a run starts (`restore` loads a checkpoint's)."""
    gold, policy_path, reward_path = None, args.model, args.reward_model
    if args.model in WORLDS:  # built on first use under runs/<name>/
        world = importlib.import_module(args.model)
        policy_path, world_reward = world.build_world()
        reward_path = reward_path or (None if args.reward_fn or args.env else world_reward)
        gold = None if args.env else getattr(world, "gold", None)
    if reward_path is None and args.reward_fn is None and args.env is None and args.teacher is None:
        fail("no reward: give --reward-model (a sequence classifier with one label), --reward-fn FILE.py:NAME and/or "
             "--teacher PATH")
    reward_fn = load_python(args.reward_fn, "--reward-fn") if args.reward_fn else None
    if reward_fn is not None and not callable(reward_fn):
        fail(f"--reward-fn {args.reward_fn!r} is a {type(reward_fn).__name__}, not a function "
             "f(prompts, responses, **columns)")
    env = load_env(args.env) if args.env else None
    if args.vllm:
        try:
            adapters.check_vllm(AutoConfig.from_pretrained(policy_path, trust_remote_code=args.trust_remote_code))
        except ValueError as e:
            fail(str(e))
    tokenizer = load_tokenizer(policy_path, "--model", args, padding_side="left")
    if args.tools:  # tools.py's episodes, scored on the final answer; it has the tokenizer render the tools' schemas
        import tools  # (and sandbox.py: a fork without --tools needs neither)
        env = tools.episodes(args, tokenizer, fail, lambda p, t, c, fn=reward_fn: args.reward_fn_weight *
                             reward_fn_scores(fn, args, [p], [t], c, "cpu")[0].item())
        reward_fn = None
    rm_tokenizer = None  # None: the RM reads the policy's tokens directly
    if reward_path is not None:
        rm_tokenizer = load_tokenizer(reward_path, "--reward-model", args)
        if rm_tokenizer.get_vocab() == tokenizer.get_vocab():
            rm_tokenizer = None
        else:
            log("the reward model has its own tokenizer: responses are decoded and re-tokenized for it")
    critic_init = args.critic_init
    if critic_init == "auto":
        critic_init = "reward" if reward_path is not None and rm_tokenizer is None else "policy"
    if critic_init == "reward" and not args.critic_model and (reward_path is None or rm_tokenizer is not None):
        fail("--critic-init reward needs a reward model that shares the policy's tokenizer; use --critic-init policy")
    if args.unread_reference and args.kl_coef > 0:
        log("note: --unread-reference changes nothing at --kl-coef > 0, where the KL reads the reference anyway")
    if args.lora_rank:
        policy = add_lora(load_model(AutoModelForCausalLM, policy_path, "--model", args), args, "--model")
        ref_policy = None if no_reference(args) else AdaptersOff(policy)
    else:
        policy = load_model(AutoModelForCausalLM, policy_path, "--model", args)
        ref_policy = None if no_reference(args) else load_model(AutoModelForCausalLM, args.ref_model or policy_path,
                                                                "--ref-model", args)
    teacher = args.teacher and load_model(AutoModelForCausalLM, args.teacher, "--teacher", args)
    theirs = args.teacher and load_tokenizer(args.teacher, "--teacher", args)
    if theirs and (theirs.get_vocab(), theirs.chat_template) != (tokenizer.get_vocab(), tokenizer.chat_template):
        fail(f"--teacher {args.teacher}'s tokenizer ({len(theirs)} tokens) is not --model {args.model}'s "
             f"({len(tokenizer)} tokens), or its chat template differs: a teacher here scores the student's own ids")
    reward_model = reward_path and ValueModel(load_model(AutoModelForSequenceClassification, reward_path,
                                                         "--reward-model", args))
    critic_path = args.critic_model or (reward_path if critic_init == "reward" else policy_path)
    if not ESTIMATORS[args.adv_estimator]["critic"]:
        critic = None  # critic-free: the group of samples is the baseline
    elif critic_init == "scratch":
        config = AutoConfig.from_pretrained(policy_path, num_labels=1, trust_remote_code=args.trust_remote_code)
        with own_rng(device):  # a random init that leaves the sampling stream as it was
            critic = disable_dropout(AutoModelForSequenceClassification.from_config(config, dtype=torch.float32))
    else:  # from the policy or another checkpoint: the backbone is loaded and the scalar head starts fresh
        critic = load_model(AutoModelForSequenceClassification, critic_path, "--critic-model", args, num_labels=1)
    if critic is not None and args.lora_rank:  # its own base and adapters, the value head trained whole
        add_lora(critic, args, "the critic", head="score")
    critic = critic and ValueModel(critic)
    shipped_tokenizer = load_tokenizer(policy_path, "--model", args)
    stop_ids = stop_token_ids(tokenizer, policy.generation_config, args.stop_tokens)
    log("responses end at " + ", ".join(f"{tokenizer.convert_ids_to_tokens(i)!r} ({i})" for i in stop_ids))
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id in stop_ids:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(  # a pad that is no stop token, from the vocabulary
            next(i for i in (tokenizer.unk_token_id, *range(len(tokenizer))) if i is not None and i not in stop_ids))
        log(f"the tokenizer has no pad token apart from its stop tokens: batches are padded with "
            f"{tokenizer.pad_token!r} (id {tokenizer.pad_token_id}); the saved tokenizer is left as it was")
    if rm_tokenizer is not None and rm_tokenizer.pad_token is None:  # right padding, read before it: any id
        rm_tokenizer.pad_token = rm_tokenizer.eos_token or rm_tokenizer.convert_ids_to_tokens(0)
    shares_tokens = [m.seq_cls for m in (critic, reward_model if rm_tokenizer is None else None) if m]
    for model in [policy, teacher] + [ref_policy] * (not args.lora_rank and ref_policy is not None) + shares_tokens:
        if model and model.get_input_embeddings().num_embeddings < len(tokenizer):
            model.resize_token_embeddings(len(tokenizer))
    policy, ref_policy, critic = (m and m.to(device) for m in (policy, ref_policy, critic))
    if args.logprob_chunk and not all(chunked_head_works(m, device) for m in (policy, ref_policy, teacher) if m):
        log(f"{type(policy).__name__} transforms its logits after the head: log-probs from all the logits at once")
        args.logprob_chunk = 0  # (so config.json says what runs)
    for model in [m for m in (policy, ref_policy, teacher, critic) if m] if args.pack else ():
        if not packing_works(model, device):
            log(f"{type(model).__name__} attends across packed rows: its passes run on padded rows")
    if args.teacher and args.distill == "loss" and not args.logprob_chunk:  # (it reads the head's states)
        fail("--distill loss takes each model's head a chunk at a time: set --logprob-chunk > 0, with models whose "
             "logits are their head's")
    if args.lora_base_dtype == "bf16":  # (after the head check, whose forward runs without autocast)
        for model in [m for m in (policy, critic and critic.seq_cls) if m is not None]:
            bf16_bases(model)
    for model in [m for m in (policy, ref_policy) if m] if args.fp32_head else ():  # (LoRA: one head for both)
        fp32_head(model.get_output_embeddings())
    frozen_device = torch.device("cpu") if args.offload_frozen else device
    reward_model, ref_policy, teacher = (m and m.to(frozen_device) for m in (reward_model, ref_policy, teacher))
    stored = (stored_dtype(policy_path, args), critic and stored_dtype(critic_path, args))  # the final models' dtypes
    return Models(tokenizer, shipped_tokenizer, policy.generation_config, stop_ids, policy, ref_policy, teacher, critic,
                  reward_model, rm_tokenizer, reward_fn, env, gold, policy_path, critic_path, stored, swapped=[])


def adamw(params, lr, fused, name, log):
    """torch's AdamW (eps 1e-5, N+), with its fused kernel where torch has one (TRL's default optim); logged."""
    kernel = fused and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    log(f"{name}'s AdamW: " + ("fused" if kernel else "torch's default" + (", no fused kernel here" if fused else "")))
    return torch.optim.AdamW(params, lr=lr, eps=1e-5, fused=kernel or None)


def no_reference(args):
    """Beta 0: no KL reads the reference (TRL's default since 2025), so neither its copy nor its pass is paid for."""
    return args.kl_coef == 0 and not args.unread_reference


def stop_token_ids(tokenizer, generation_config, stop_tokens=None):
    """The ids that end a response everywhere: --stop-tokens, or generation_config's eos ids, EOS, end of turn."""
    if stop_tokens:
        ids, unk = [tokenizer.convert_tokens_to_ids(t) for t in stop_tokens], tokenizer.unk_token_id
        unknown = [t for t, i in zip(stop_tokens, ids) if i is None or (i == unk and t != tokenizer.unk_token)]
        if unknown:
            fail(f"--stop-tokens {unknown} are not tokens of the policy's tokenizer: give tokens as it spells them")
        return sorted(set(ids))
    eos = generation_config.eos_token_id if generation_config is not None else None
    ids = set([eos] if isinstance(eos, int) else eos or [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if tokenizer.chat_template:
        ids |= set(end_of_turn(tokenizer))
    if not ids:
        fail("the policy's tokenizer has no EOS, its generation_config no eos_token_id and no chat template: "
             "say which tokens end a response with --stop-tokens")
    return sorted(ids)


def end_of_turn(tokenizer):
    """The special token that follows an assistant message in the chat template ([] if none does)."""
    marker = "zqxj"
    try:
        turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}]
        text = tokenizer.apply_chat_template(turns, tokenize=False)
    except Exception:  # a template that wants other roles: no end-of-turn token from it
        return []
    after = tokenizer(text[text.rindex(marker) + len(marker):], add_special_tokens=False).input_ids
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    return [i for i in after if i in special][:1]


class ValueModel(nn.Module):
    """Per-token scalar head on an HF sequence classifier's backbone (the critic, and the RM read at one position)."""
    def __init__(self, seq_cls):
        super().__init__()
        self.seq_cls = seq_cls

    def forward(self, input_ids, position_ids, attention_mask=None, **kw):
        backbone = getattr(self.seq_cls, self.seq_cls.base_model_prefix)
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False).last_hidden_state  # (b, P+T, H)
        return self.seq_cls.score(hidden).squeeze(-1).float()  # (b, P+T)


# --- LoRA (peft) ------------------------------------------------------------------------------
# Adapters go into the HF models in place; the base never changes: the reference is the policy, adapters off.
def add_lora(model, args, flag, head=None):
    """Adapters (fp32, dropout 0) on --lora-targets of `model`, in place; its base frozen, `head` trained whole."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.tuners_utils import BaseTunerLayer
    targets = args.lora_targets
    if targets != "all-linear":
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0, target_modules=targets,
                        exclude_modules=[head] if head else None)
    try:
        inject_adapter_in_model(config, model)
    except (ValueError, TypeError) as e:
        fail(f"--lora-targets {args.lora_targets}: {reason(e)} (for {flag}; name its linear modules, e.g. "
             "q_proj,v_proj, or give all-linear)")
    if isinstance(model.get_output_embeddings(), BaseTunerLayer):
        fail(f"--lora-targets {args.lora_targets} adapts the output head of {flag}: leave it out (the chunked "
             "head reads head.weight itself)")
    if not lora_layers(model):
        fail(f"--lora-targets {args.lora_targets}: no module of {flag} was adapted")
    from transformers.pytorch_utils import Conv1D
    other = [n for n, m in lora_layers(model).items() if not isinstance(m.get_base_layer(), (nn.Linear, Conv1D))]
    if other:  # the merge, the push and the saved checkpoint are written for linear layers' lora_A and lora_B
        fail(f"--lora-targets {args.lora_targets} adapts {other[0]} of {flag} (not a linear layer): adapters go on "
             "linear layers only; name those (e.g. q_proj,v_proj) or give all-linear")
    for name, p in model.named_parameters():
        p.requires_grad = ".lora_" in name or (head is not None and name.startswith(head + "."))
    return model


def fp32_head(head):
    """--fp32-head: the head's matmul outside autocast, on fp32 states (the chunked head reads `head.fp32`)."""
    forward, head.fp32 = head.forward, True

    def fp32_forward(hidden):
        with torch.autocast(hidden.device.type, enabled=False):
            return forward(hidden.float())
    head.forward = fp32_forward


def bf16_bases(model):
    """--lora-base-dtype bf16: the adapted layers' frozen bases in bf16, in place (bf16 autocast rounds them anyway)."""
    for layer in lora_layers(model).values():
        layer.get_base_layer().to(torch.bfloat16)


def lora_layers(model):
    """{module name: peft LoRA layer} of a model (empty without adapters, or without peft installed)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return {}
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


class AdaptersOff(nn.Module):
    """The reference under LoRA: the policy with its adapters off (as TRL and veRL), held outside the module tree."""
    def __init__(self, policy):
        super().__init__()
        self.held, self.config = (policy,), policy.config

    def forward(self, **kw):
        layers = lora_layers(self.held[0]).values()
        for layer in layers:
            layer.enable_adapters(False)
        try:
            return self.held[0](**kw)
        finally:
            for layer in layers:
                layer.enable_adapters(True)  # (peft marks the active adapters trainable again)

    def get_output_embeddings(self):
        return self.held[0].get_output_embeddings()


def shard_models(models, args, device, world):
    """Under torchrun, FSDP2 per decoder layer; the frozen models frozen; activation recomputation when asked."""
    m = models
    if world > 1:
        m.policy = shard(m.policy, m.policy._no_split_modules or [])
        m.critic = m.critic and shard(m.critic, m.critic.seq_cls._no_split_modules or [])
        if args.shard_frozen and not args.lora_rank and m.ref_policy:  # (LoRA: the reference is the policy's view)
            m.ref_policy = shard(m.ref_policy, m.ref_policy._no_split_modules or [], args.offload_frozen)
        if args.shard_frozen and m.teacher:
            m.teacher = shard(m.teacher, m.teacher._no_split_modules or [], args.offload_frozen)
        if args.shard_frozen:
            m.reward_model = m.reward_model and shard(m.reward_model, m.reward_model.seq_cls._no_split_modules or [],
                                                      args.offload_frozen)
    frozen = [x for x in (m.ref_policy, m.teacher, m.reward_model) if x and not isinstance(x, AdaptersOff)]  # (fixed)
    m.swapped = frozen if args.offload_frozen and not (world > 1 and args.shard_frozen) else []  # whole, for phase 3
    for model in frozen:
        model.requires_grad_(False)
    if args.gradient_checkpointing:  # HF recomputes only in training mode; dropout is off for good anyway
        for model in (m.policy, m.critic and m.critic.seq_cls):
            if model is not None:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def own_rng(device):
    """The global generators restored on exit: the CPU's and this rank's GPU (not fork_rng's default, every GPU)."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


# --- prompts and rewards ----------------------------------------------------------------------
def load_prompts(args, tokenizer, log, env=None):
    """Training and evaluation rows and their token ids, and the PPO-ptx texts' ids (empty without --ptx-coef)."""
    prompt_rows, eval_rows = load_prompt_rows(args, env, log)
    if not prompt_rows:
        fail("the prompt set is empty: check --dataset and --train-split")
    if args.eval_every and len(eval_rows) < rank_and_world()[1]:  # (each rank evaluates its share, all the same size)
        fail(f"--eval-every {args.eval_every}: {len(eval_rows)} evaluation prompts for {rank_and_world()[1]} rank(s), "
             "nothing to evaluate: give --eval-split, raise --eval-fraction or --eval-size, or drop --eval-every")
    if env is not None:  # an env's first observation is its prompt, rendered in each episode (`play`)
        return prompt_rows, None, eval_rows, list(range(len(eval_rows))), []
    for i, row in enumerate(prompt_rows + eval_rows):
        check_prompt(row["prompt"], tokenizer, f"--dataset row {i} ({args.prompt_column!r})")
    prompt_ids, eval_ids = ([render_prompt(tokenizer, r["prompt"]) for r in rows] for rows in (prompt_rows, eval_rows))
    empty = [i for i, p in enumerate(prompt_ids + eval_ids) if not p]
    if empty:
        fail(f"--dataset row {empty[0]}: the prompt gives no tokens ({len(empty)} such rows), and generation needs "
             "at least one: drop empty prompts")
    too_long = sum(len(p) > args.max_prompt_length for p in prompt_ids + eval_ids)
    if too_long and not args.truncate_prompts:
        fail(f"{too_long} of {len(prompt_ids + eval_ids)} prompts are longer than --max-prompt-length "
             f"{args.max_prompt_length} tokens: raise it, or pass --truncate-prompts to keep their last tokens")
    if too_long:
        log(f"truncated {too_long} of {len(prompt_ids + eval_ids)} prompts to their last {args.max_prompt_length} "
            "tokens")
        prompt_ids, eval_ids = ([p[-args.max_prompt_length:] for p in ids] for ids in (prompt_ids, eval_ids))
    ptx_ids = []
    if args.ptx_coef > 0:  # texts for the PPO-ptx loss
        world = importlib.import_module(args.model if args.model in WORLDS else "toy")
        texts = world.sft_texts(2048) if args.ptx_dataset is None else load_prompt_rows(
            Args(dataset=args.ptx_dataset, prompt_column="text", eval_fraction=0))[0]
        ptx_ids = tokenizer([t if isinstance(t, str) else t["prompt"] for t in texts], truncation=True,
                            max_length=args.max_prompt_length + args.response_length).input_ids
    return prompt_rows, prompt_ids, eval_rows, eval_ids, ptx_ids


def load_prompt_rows(args, env=None, log=print):
    """Training and evaluation rows (dicts: the prompt, other columns), apart (`hold_out`) but in closed worlds."""
    if args.dataset is None and env is not None:  # the env's own rows
        if not callable(getattr(env, "rows", None)):
            fail(f"{args.episodes} has no rows: pass --dataset, or give the class a static rows(n, seed)")
        rows = [env_call(args, 0, env.rows, n, seed) for n, seed in ((2048, 1234), (args.eval_size, 4321))]
        if not all(isinstance(r, list) and all(isinstance(x, dict) for x in r) for r in rows) or not rows[0]:
            fail(f"{args.episodes}: rows(n, seed) must return a non-empty list of dicts")
        return rows
    if args.dataset is None:  # a built-in world's prompts (the toy's for any other --model)
        world = importlib.import_module(args.model if args.model in WORLDS else "toy")
        train, candidates = ([{"prompt": p} for p in world.prompts(n, seed=s)]
                             for n, s in ((2048, 1234), (2 * args.eval_size, 4321)))
        if getattr(world, "CLOSED", False):  # every prompt is a training prompt: evaluation reuses them
            return train, candidates[:args.eval_size]
        return generated_split(train, candidates, args, log)
    if args.dataset.startswith("reasoning-gym:"):
        try:  # (adapters.py: the generator's rows, the prompt as one user message, the entry for the reward)
            return generated_split(*adapters.reasoning_gym_rows(args, args.dataset), args, log)
        except ValueError as e:
            fail(str(e))
    import datasets
    ext = os.path.splitext(args.dataset)[1]
    local = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(ext)
    if local and not os.path.isfile(args.dataset):
        fail(f"--dataset {args.dataset!r}: no such file")
    if os.path.isfile(args.dataset) and os.path.getsize(args.dataset) == 0:
        fail(f"the prompt set is empty: {args.dataset} has no rows")
    try:
        ds = datasets.load_dataset(local, data_files=args.dataset) if local else datasets.load_dataset(args.dataset)
        train = ds[args.train_split]
    except Exception as e:  # a missing file, no network, an unknown split: all one line for the user
        fail(f"--dataset {args.dataset!r} (split {args.train_split!r}) cannot be loaded: {reason(e)}")
    if args.prompt_column not in train.column_names and env is None:
        fail(f"--dataset has no column {args.prompt_column!r} (it has {train.column_names}): set --prompt-column")
    try:  # the rows are decoded only here
        train = [dict(r, prompt=r.get(args.prompt_column)) for r in train]
        if args.eval_split is not None:
            held_out = ds[args.eval_split]  # (only the rows evaluated are decoded)
            return train, [dict(r, prompt=r.get(args.prompt_column))
                           for r in held_out.select(range(min(args.eval_size, len(held_out))))]
    except UnicodeDecodeError as e:
        fail(f"--dataset {args.dataset!r} cannot be loaded: it is not UTF-8 text ({reason(e)})")
    first = {}  # question -> its first row: --eval-fraction of the distinct prompts (not rows), drawn by --seed
    for r in train:
        first.setdefault(question(r), r)
    n = math.ceil(args.eval_fraction * len(first)) if len(first) > 1 else 0
    drawn, rows = np.random.default_rng(args.seed).permutation(len(first))[:n], list(first.values())
    return hold_out(train, [rows[i] for i in drawn], min(n, args.eval_size))


def question(row):
    """What makes two rows one question: reasoning-gym's question text, else the prompt (chat as JSON), else the row."""
    q = row["entry"]["question"] if "entry" in row else row.get("prompt")
    return q if isinstance(q, str) else json.dumps(row if q is None else q, sort_keys=True, default=str)


def hold_out(train, candidates, limit):
    """The first `limit` distinct questions of `candidates`, one row each, and the training rows of other questions."""
    held, taken = [], set()
    for r in candidates:
        if len(held) < limit and question(r) not in taken:
            held.append(r)
            taken.add(question(r))
    return [r for r in train if question(r) not in taken], held


def generated_split(train, candidates, args, log):
    """A generator's evaluation rows: its first --eval-size distinct questions, out of training, at most half of all."""
    space = len({question(r) for r in train + candidates})
    train, held = hold_out(train, candidates, min(args.eval_size, space // 2))
    if len(held) < args.eval_size and args.eval_every:
        log(f"warning: {len(held)} distinct evaluation questions, fewer than --eval-size {args.eval_size}: the task "
            f"drew {space} questions in all, and half stay for training")
    return train, held


def check_prompt(prompt, tokenizer, where):
    """A prompt is a string, or a non-empty list of {"role": str, "content": str} rendered by a chat template."""
    if isinstance(prompt, str):
        return
    if not isinstance(prompt, list) or not prompt:
        fail(f"{where} is {prompt!r:.60}: a prompt is a string or a list of chat messages")
    for m in prompt:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            fail(f"{where} has the chat message {m!r:.60}: each needs a string 'role' and a string 'content'")
    if not tokenizer.chat_template:
        fail(f"{where} is a list of chat messages, but the tokenizer has no chat template: give string prompts, "
             "or a checkpoint with a chat template")


def render_prompt(tokenizer, prompt):
    """Prompt ids: chat messages through the chat template with the generation prompt; a string as it is (and BOS)."""
    if isinstance(prompt, list):
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False).input_ids
    return tokenizer(prompt).input_ids


def render_for_rm(rm_tokenizer, prompt, response):
    """Prompt + decoded response as the reward model reads them: through its own chat template, else as plain text."""
    if rm_tokenizer.chat_template:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        return rm_tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": response}], tokenize=False)
    if isinstance(prompt, list):
        prompt = "\n".join(m["content"] for m in prompt)
    sep = "" if prompt[-1:].isspace() or response[:1].isspace() else " "
    return prompt + sep + response


def load_python(spec, flag):
    """`FILE.py:NAME` or `module:NAME` -> the object (--reward-fn's function, --env's class)."""
    if spec == "reasoning-gym":  # the task's own score_answer (adapters.py)
        return adapters.reasoning_gym_reward
    import importlib.util
    path, _, name = spec.rpartition(":")
    try:
        if path.endswith(".py"):
            module_spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(path)
        return getattr(module, name)
    except Exception as e:  # a missing file or name, an import or syntax error in it: one line
        fail(f"{flag} {spec!r} cannot be loaded ({type(e).__name__}: {reason(e)}): give FILE.py:NAME or module:NAME")


def reward_fn_scores(fn, args, prompts, texts, columns, device):
    """Call --reward-fn and check what it returns: one finite number per response, nothing broadcast."""
    name = f"--reward-fn {args.reward_fn}"
    try:
        values = fn(prompts, texts, **columns)
    except Exception as e:
        if args.debug:
            raise
        fail(f"{name} raised {type(e).__name__}: {reason(e)} (it is called as f(prompts, responses, **columns), "
             f"columns: {sorted(columns) or 'none'}; --debug shows the traceback)")
    if isinstance(values, (torch.Tensor, np.ndarray)):
        values = values.tolist()
    if not isinstance(values, (list, tuple)) or len(values) != len(texts):
        got = f"{len(values)} values" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
        fail(f"{name} returned {got} for {len(texts)} responses: return a list of one float per response")
    bad = [i for i, v in enumerate(values)  # bools count as 0 / 1
           if not isinstance(v, (int, float, np.number, np.bool_)) or not math.isfinite(v)]
    if bad:
        fail(f"{name} returned {values[bad[0]]!r} for response {bad[0]} ({len(bad)} of {len(values)} are not "
             "finite numbers): return one finite float per response")
    return torch.tensor([float(v) for v in values], device=device)


def reward_model_scores(reward_model, rm_tokenizer, query_responses, attention_mask, lengths, P, rm_texts, micro,
                        budget=None):
    """The RM's score per response, in micro-batches: at the last real token, or on the texts in its own tokens."""
    scores = torch.zeros(len(lengths), device=lengths.device)  # (B,)
    if rm_tokenizer is not None:  # right-padded, so each micro-batch is trimmed to its longest row
        enc = rm_tokenizer(rm_texts, padding=True, padding_side="right", return_tensors="pt",
                           add_special_tokens=not rm_tokenizer.chat_template).to(lengths.device)
        rm_lengths = enc.attention_mask.sum(1)  # (B,)
    for rows in micro_batches(lengths if rm_tokenizer is None else rm_lengths, P if rm_tokenizer is None else 0,
                              micro, budget):  # (b,) row indices each
        if rm_tokenizer is None:
            t = int(lengths[rows].max())
            v = state_values(reward_model, query_responses[rows, :P + t], attention_mask[rows, :P + t], P)  # (b, t+1)
            scores[rows] = v.gather(1, lengths[rows, None]).squeeze(1)  # (b,): column `length` = last real token
        else:
            n = int(rm_lengths[rows].max())
            v = forward(reward_model, enc.input_ids[rows, :n], enc.attention_mask[rows, :n])  # (b, n)
            scores[rows] = v.gather(1, rm_lengths[rows, None] - 1).squeeze(1)  # (b,)
    return scores  # (B,)


# --- environments (--env): multi-turn episodes --------------------------------------------------
def load_env(spec):
    if spec.startswith("textarena/"):  # a game by its TextArena id, e.g. textarena/GuessTheNumber-v0
        try:
            return adapters.textarena_game(spec.split("/", 1)[1])
        except ValueError as e:
            fail(f"--env {spec}: {e}")
    env = load_python(spec, "--env")
    if not (isinstance(env, type) and callable(getattr(env, "reset", None)) and callable(getattr(env, "step", None))):
        what = "a class without them" if isinstance(env, type) else f"a {type(env).__name__}"
        fail(f"--env {spec!r} must be a class with reset(row, seed) and step(action_text): it is {what}")
    return env


def play(env_class, policy, tokenizer, rows, seeds, device, args, greedy=False, synced=False, llm=None, sampler=None,
         keys=None):
    """--env's phases 1-2, sampled ids kept (TRL #5224, veRL #6719): `Sampled`'s fields query_responses .. turn_ends."""
    stop_ids = set(torch.tensor(policy.generation_config.eos_token_id).flatten().tolist())
    context = min(getattr(policy.config, "max_position_embeddings", None) or math.inf,
                  args.max_prompt_length + args.max_episode_tokens if llm is not None else math.inf)  # positions
    envs = [env_call(args, 0, env_class) for _ in rows]  # (a constructor that raises: one line too)
    chats, prompts = zip(*[first_observation(tokenizer, env_call(args, 0, env.reset, row, int(seed)), args)
                           for env, row, seed in zip(envs, rows, seeds)])  # the conversations; the prompt ids
    B, cap = len(rows), args.max_episode_tokens
    ids, action, reward, ends, engine = ([[] for _ in range(B)] for _ in range(5))  # per episode, per token
    over, done = [False] * B, [False] * B
    for turn in range(1, args.max_turns + 1):
        live = [i for i in range(B) if not over[i]]
        if global_max(float(len(live)), device) == 0:  # all ranks: a sharded forward needs every one of them
            break
        contexts = [prompts[i] + ids[i] for i in live or [0]]  # a rank with no live episode still joins in
        turn_keys = keys and [keys[i] if turn == 1 else  # (turn 1 draws as a single-turn row does)
                              int(np.random.SeedSequence([keys[i], turn]).generate_state(1)[0]) for i in live or [0]]
        qr, _, lengths, _, _, P, engine_logprobs = generate(policy, tokenizer, contexts, device, greedy, synced, llm,
                                                            sampler, turn_keys)
        for k, i in enumerate(live):
            n = min(int(lengths[k]), cap - len(ids[i]))  # the episode's token cap may cut the turn short
            turn_ids = qr[k, P:P + n].tolist()  # the sampled ids, as they are
            text = tokenizer.decode(turn_ids, skip_special_tokens=True)
            observation, r, done[i] = env_step(args, envs[i], text, turn)
            ids[i] += turn_ids
            action[i] += [1.0] * n
            reward[i] += [0.0] * (n - 1) + [r]  # on the turn's last agent token
            ends[i] += [0.0] * (n - 1) + [1.0]
            engine[i] += engine_logprobs[k, :n].tolist() if engine_logprobs is not None else [0.0] * n
            over[i] = done[i] or turn == args.max_turns or len(ids[i]) >= cap
            if not over[i]:
                stop_id = turn_ids[-1] if turn_ids[-1] in stop_ids else None
                obs_ids = observation_ids(tokenizer, chats[i], text, observation, stop_id, args, turn)
                if len(obs_ids) >= cap:
                    fail(f"{args.episodes}: the observation after turn {turn} is {len(obs_ids)} tokens, no room left "
                         f"in --max-episode-tokens {cap}: raise it, or shorten the observations")
                over[i] = (len(ids[i]) + len(obs_ids) >= cap  # no room for the next turn: cut here
                           or len(prompts[i]) + len(ids[i]) + len(obs_ids) + args.response_length > context)
            if not over[i]:
                ids[i] += obs_ids
                action[i] += [0.0] * len(obs_ids)
                for per_token in (reward, ends, engine):  # the observation: no reward, no turn's end, no sampling
                    per_token[i] += [0.0] * len(obs_ids)
    enc = tokenizer.pad({"input_ids": list(prompts)}, return_tensors="pt").to(device)
    P, T = enc.input_ids.shape[1], max(map(len, ids))
    padded = lambda rows, fill: torch.tensor([r + [fill] * (T - len(r)) for r in rows], device=device)  # (B, T)
    lengths = torch.tensor([len(r) for r in ids], device=device)  # (B,): the episode's tokens
    mask = padded(action, 0.0)  # (B, T): the action mask
    query_responses = torch.cat([enc.input_ids, padded(ids, tokenizer.pad_token_id)], 1)  # (B, P+T)
    attention_mask = torch.cat([enc.attention_mask, (torch.arange(T, device=device) < lengths[:, None]).long()], 1)
    has_eos = torch.tensor(done, device=device)  # (B,): True = the env ended the episode
    engine_logprobs = padded(engine, 0.0) if llm is not None or sampler is not None else None  # (B, T)
    return (query_responses, attention_mask, lengths, has_eos, mask, P, engine_logprobs, padded(reward, 0.0),
            padded(ends, 0.0))


def env_call(args, turn, method, *a):
    """An env's method, its exceptions one line that names the env, the method and the turn."""
    try:
        return method(*a)
    except Exception as e:
        if args.debug or isinstance(e, UsageError):  # (one line already: --tools' reward function's)
            raise
        fail(f"{args.episodes}: {method.__name__}() raised {type(e).__name__} on turn {turn}: {reason(e)} (fix the "
             "env; --debug shows the traceback)")


def check_observation(observation, args, where):
    if isinstance(observation, str) or (isinstance(observation, list) and observation and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in observation)):
        return
    fail(f"{args.episodes}: {where} the observation {observation!r:.60}: return a string or a non-empty list of "
         "chat messages {'role': str, 'content': str}")


def env_step(args, env, action_text, turn):
    """step(action_text) -> (observation, reward, done), checked."""
    out = env_call(args, turn, env.step, action_text)
    where = f"step() on turn {turn} returned"
    if not (isinstance(out, tuple) and len(out) == 3):
        fail(f"{args.episodes}: {where} {out!r:.60}: return a tuple (observation, reward, done)")
    observation, reward, done = out
    if not isinstance(reward, (int, float, np.number, np.bool_)) or not math.isfinite(reward):
        fail(f"{args.episodes}: {where} the reward {reward!r:.40}: return a finite number")
    if not isinstance(done, (bool, np.bool_)):
        fail(f"{args.episodes}: {where} done = {done!r:.40}: return True or False")
    if not done:  # (the observation of a finished episode is never read)
        check_observation(observation, args, where)
    return observation, float(reward), bool(done)


def first_observation(tokenizer, observation, args):
    """reset()'s observation as prompt ids, and the chat so far (None for raw text; a string is a user message)."""
    check_observation(observation, args, "reset() returned")
    if not tokenizer.chat_template and not isinstance(observation, str):
        fail(f"{args.episodes}: reset() returned chat messages; the tokenizer has no chat template: return a string")
    chat = None
    if tokenizer.chat_template:
        chat = [{"role": "user", "content": observation}] if isinstance(observation, str) else list(observation)
    try:
        ids = render_prompt(tokenizer, observation if chat is None else chat)
    except Exception as e:  # a template that refuses these messages (roles that must alternate, say)
        fail(f"{args.episodes}: the chat template cannot render reset()'s observation ({reason(e)})")
    if not 0 < len(ids) <= args.max_prompt_length:
        fail(f"{args.episodes}: reset()'s observation is {len(ids)} tokens: it must be 1 to --max-prompt-length "
             f"{args.max_prompt_length}")
    return chat, ids


MARK = "\ue000"  # a private-use character: where an assistant turn's content sits in a rendered template


def observation_ids(tokenizer, chat, action_text, observation, stop_id, args, turn):
    """The ids appended after an agent turn: raw text tokenized alone, or what the chat template adds. `chat` grows."""
    if chat is None:
        if not isinstance(observation, str):
            fail(f"{args.episodes}: step() on turn {turn} returned chat messages, but the tokenizer has no chat "
                 "template: return a string")
        return tokenizer(observation, add_special_tokens=False).input_ids
    role = "tool" if re.search(r"""["']tool["']""", tokenizer.chat_template) else "user"
    new = [{"role": role, "content": observation}] if isinstance(observation, str) else list(observation)
    turn_mark, said = [{"role": "assistant", "content": MARK}], [{"role": "assistant", "content": action_text}]
    try:  # with the turn's text (does the template rewrite it once a message follows?) and with a mark in its place
        before, with_text, after_text, with_turn, after = (
            tokenizer.apply_chat_template(m, add_generation_prompt=g, tokenize=False)
            for m, g in ((chat, True), (chat + said, False), (chat + said + new, True), (chat + turn_mark, False),
                         (chat + turn_mark + new, True)))
    except Exception as e:
        fail(f"{args.episodes}: the chat template cannot render the observation of turn {turn} ({reason(e)})")
    if not (with_text.startswith(before) and after_text.startswith(with_text) and with_turn.startswith(before)
            and after.startswith(with_turn) and MARK in with_turn[len(before):]):
        fail(f"{args.episodes}: the chat template rewrites earlier turns (e.g. drops their reasoning), so the "
             f"episode's tokens would not be what the model sees on turn {turn + 1}: use a template that only appends")
    end = with_turn[with_turn.index(MARK, len(before)) + len(MARK):]  # the template's end of an assistant turn
    stop_text = tokenizer.decode([stop_id]) if stop_id is not None else ""
    if stop_text and stop_text in end:
        end = end.split(stop_text, 1)[1]  # the agent sampled that token itself
    chat += said + new
    return tokenizer(end + after[len(with_turn):], add_special_tokens=False).input_ids


# --- a batch of samples in parts (--dynamic-sampling) -----------------------------------------
def refill_order(update, refill, questions, args, rank, world):
    """--dynamic-sampling's rows for refill round `refill`, as `prompt_order`'s: questions not drawn yet, or None."""
    n_prompts, n_rows = args.batch_size // args.group_size, len(questions)
    drawn = prompt_order(update, n_rows, args, 0, args.batch_size)  # (B,): the update's batch, all ranks'
    for r in range(1, refill + 1):
        order = np.random.default_rng([args.seed, STREAMS["refills"], update, r]).permutation(n_rows)  # (n_rows,)
        order = order[~np.isin(questions[order], questions[drawn])]  # the questions not drawn yet...
        order = order[np.sort(np.unique(questions[order], return_index=True)[1])][:n_prompts]  # ...each once
        order = order[:len(order) // world * world]  # equal shares
        if len(order) == 0:
            return None
        drawn = np.concatenate([drawn, order])
    batch_idx = np.repeat(order, args.group_size)  # (b,): groups side by side
    share = len(batch_idx) // world
    return batch_idx[rank * share: (rank + 1) * share]  # (b / N,)


def pick(batch, idx):
    """The rows `idx` (n,) of a Sampled."""
    def take(x):
        if isinstance(x, torch.Tensor):
            return x[idx]
        return [x[i] for i in idx.tolist()] if isinstance(x, list) else x  # (P and None as they are)
    return Sampled(*map(take, batch[:-1]), {k: v[idx] for k, v in batch.score_parts.items()})


def join(parts, pad_id):
    """Several Sampled as one: prompts left-padded to the longest, responses right-padded to the longest."""
    P, T = max(b.P for b in parts), max(b.mask.shape[1] for b in parts)
    pad = lambda b, x, value: torch.nn.functional.pad(x, (P - b.P, T - b.mask.shape[1]), value=value)  # (b, P+T)
    right = lambda b, x: None if x is None else torch.nn.functional.pad(x, (0, T - x.shape[1]))  # (b, T)
    cat = lambda xs: None if xs[0] is None else torch.cat(xs) if isinstance(xs[0], torch.Tensor) else sum(xs, [])
    return Sampled(cat([b.rows for b in parts]), cat([pad(b, b.query_responses, pad_id) for b in parts]),
                   cat([pad(b, b.attention_mask, 0) for b in parts]), cat([b.lengths for b in parts]),
                   cat([b.has_eos for b in parts]), cat([right(b, b.mask) for b in parts]), P,
                   cat([right(b, b.engine_logprobs) for b in parts]), cat([right(b, b.turn_rewards) for b in parts]),
                   cat([right(b, b.turn_ends) for b in parts]),
                   cat([b.texts for b in parts]), cat([b.scores for b in parts]),
                   {k: cat([b.score_parts[k] for b in parts]) for k in parts[0].score_parts})


# --- memory and padding: micro-batches, packed rows, the policy head in chunks ---------------
def micro_batches(lengths, P, rows, budget=None, real=None):
    """Each micro-batch's row indices: `rows` at a time, or by length to `budget` tokens: padded ones (veRL's), or
    real ones where `real` gives each row's (packed passes)."""
    order = torch.arange(len(lengths), device=lengths.device)  # (B,)
    if budget is None:
        batches = list(order.split(rows))
    else:
        order, batches = lengths.argsort(descending=True, stable=True), []  # (B,): longest first
        while len(order):
            n = max(1, budget // (P + int(lengths[order[0]])) if real is None else  # (the first row is the longest)
                    int((real[order].cumsum(0) <= budget).sum()))
            batches, order = batches + [order[:n]], order[n:]
    most = global_max(float(len(batches)), lengths.device)  # one all-reduce on every rank
    while len(batches) < most:
        i = max(range(len(batches)), key=lambda j: len(batches[j]))
        batches[i: i + 1] = list(batches[i].chunk(2))
    return batches


def packed_tokens(attention_mask, model):
    """Each row's real tokens (B,) where `model` runs packed (a micro-batch's --micro-batch-tokens counts those)."""
    return attention_mask.sum(1) if getattr(model, "pack", False) else None


def head_states(model, query_responses, attention_mask, P):
    """The head's input before each response token (b*T, H), the head and its logits' cap: the model's own forward
    (under FSDP2 too, which leaves the root's head weight gathered), its head run on nothing."""
    T = query_responses.shape[1] - P
    head, captured = model.get_output_embeddings(), []

    def take_hidden(module, inputs):  # the head's input, (b, T+1, H); the head itself then runs on nothing
        captured.append(inputs[0])
        return (inputs[0][:, :0],)
    hook = head.register_forward_pre_hook(take_hidden)
    try:
        forward(model, query_responses, attention_mask, logits_to_keep=T + 1)
    finally:
        hook.remove()
    fp32 = getattr(head, "fp32", False)  # --fp32-head: its states in fp32
    softcap = getattr(model.config, "final_logit_softcapping", None)  # (Gemma 2 caps its logits)
    return (captured[0].float() if fp32 else captured[0])[:, :-1].flatten(0, 1), head, softcap  # (b*T, H)


def chunked_logprobs(model, query_responses, attention_mask, P, temperature, with_entropy, chunk, keep=None,
                     sampler_filter=None, states=None):
    """`policy_logprobs` without the (b, T, V) logits: the head on `chunk` positions at a time (`HeadLogprobs`)."""
    T = query_responses.shape[1] - P
    hidden, head, softcap = head_states(model, query_responses, attention_mask, P)  # (b*T, H)
    if states is not None:
        states += [hidden, head, softcap]
    fp32 = getattr(head, "fp32", False)  # --fp32-head: the chunks' matmuls in fp32 too, outside autocast
    amp = torch.autocast(hidden.device.type, enabled=False) if fp32 else contextlib.nullcontext()
    tokens = query_responses[:, P:].flatten()  # (b*T,)
    valid = attention_mask[:, P:].flatten().bool()  # (b*T,): padding was not sampled
    parts = []
    for i in range(0, len(tokens), chunk):
        j = min(i + chunk, len(tokens))
        chunk_keep = None
        if keep is not None:  # the pairs of positions i..j-1 (sorted by position), renumbered from 0
            lo, hi = torch.searchsorted(keep[0], torch.tensor([i, j], device=tokens.device)).tolist()
            chunk_keep = (keep[0][lo:hi] - i, keep[1][lo:hi])
        with amp:  # (HeadLogprobs' backward runs under the autocast its forward saw)
            if torch.is_grad_enabled():  # (the sampler's support is only found in the no-grad rollout pass)
                parts.append(HeadLogprobs.apply(hidden[i:j], head.weight, head.bias, tokens[i:j], temperature,
                                                with_entropy, softcap, *(chunk_keep or (None, None))) + (None,))
            else:
                sampler = sampler_filter and (*sampler_filter, valid[i:j])
                parts.append(head_chunk(hidden[i:j], head.weight, head.bias, tokens[i:j], temperature, with_entropy,
                                        softcap, chunk_keep, sampler))
    logprobs = torch.cat([p[0] for p in parts]).view(-1, T)  # (b, T)
    entropy = torch.cat([p[1] for p in parts]).view(-1, T) if with_entropy else None  # (b, T)
    if sampler_filter is not None:  # the pairs found, numbered over all b*T positions again
        keep = (torch.cat([p[2][0] + i * chunk for i, p in enumerate(parts)]), torch.cat([p[2][1] for p in parts]))
    return logprobs, entropy, keep


def head_chunk(hidden, weight, bias, tokens, temperature, with_entropy, softcap=None, keep=None, sampler=None):
    """(n, H) states -> log-probs, entropies (n,) of softmax(head / tau) on `keep`, or on `sampler`'s (returned)."""
    s = head_logits(hidden, weight, bias, temperature, softcap)  # (n, V)
    if sampler is not None:
        keep = (sampling_support(s, *sampler[:2], tokens) & sampler[2][:, None]).nonzero(as_tuple=True)  # (N,) each
    support = None if keep is None else dense_support(keep, *s.shape)  # (n, V)
    logprobs, entropy = logprobs_from_logits(s, tokens, 1.0, with_entropy, support)  # (n,) each
    return logprobs, entropy, keep if sampler is not None else None


def head_logits(hidden, weight, bias, temperature, softcap=None):
    """s = head(states) / tau: (n, V) fp32, divided in place (one (n, V) tensor, not two)."""
    logits = nn.functional.linear(hidden, weight, bias).float()  # (n, V)
    if softcap:  # Gemma 2 caps its logits: cap * tanh(logits / cap)
        logits = softcap * torch.tanh(logits / softcap)  # (n, V)
    return logits.div_(temperature)  # (n, V)


class HeadLogprobs(torch.autograd.Function):
    """`head_chunk` with its backward written out: the states are kept, not the (n, V) logits (docs/memory.md)."""
    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, temperature, with_entropy, softcap, keep_pos, keep_tok):
        keep = None if keep_pos is None else (keep_pos, keep_tok)
        logprobs, entropy, _ = head_chunk(hidden, weight, bias, tokens, temperature, with_entropy, softcap, keep)
        ctx.save_for_backward(hidden, weight, bias, tokens, keep_pos, keep_tok)
        device = hidden.device.type  # the backward rebuilds the logits under the forward's autocast
        ctx.amp = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        ctx.temperature, ctx.softcap = temperature, softcap
        return logprobs, entropy  # (n,) each; entropy None without with_entropy

    @staticmethod
    def backward(ctx, g_logprobs, g_entropy):  # (n,) each; g_entropy None without with_entropy
        hidden, weight, bias, tokens, keep_pos, keep_tok = ctx.saved_tensors
        temperature, cap = ctx.temperature, ctx.softcap
        g = g_logprobs[:, None]  # (n, 1)
        with torch.autocast(ctx.amp[0], dtype=ctx.amp[1], enabled=ctx.amp[2]):
            s = head_logits(hidden, weight, bias, temperature, cap)  # (n, V) fp32
            if cap:  # ds/dlogits through the cap: (1 - tanh^2) / tau
                dcap = (1 - (s * (temperature / cap)) ** 2) / temperature  # (n, V)
            if keep_pos is not None:
                s.masked_fill_(~dense_support((keep_pos, keep_tok), *s.shape), -math.inf)
            grad = torch.softmax(s, -1)  # (n, V): p
            if g_entropy is None:
                grad.mul_(-g)  # (n, V): -p g
            else:
                s.nan_to_num_(neginf=0.0)  # (n, V): 0 off the support, where p = 0
                s.sub_((grad * s).sum(-1, keepdim=True))  # (n, V): s - E[s], as the forward took E[s]
                grad.mul_(s.mul_(g_entropy[:, None]).add_(g)).neg_()  # (n, V): -p ((s - E[s]) g_H + g)
            grad.scatter_add_(1, tokens[:, None], g)  # (n, V): + onehot g = dloss/ds
            grad.mul_(dcap if cap else 1 / temperature)  # (n, V): dloss/dlogits of the linear
            grad = grad.to(weight.dtype)  # (n, V), as the linear's own backward would take it
            grad_hidden = (grad @ weight).to(hidden.dtype)  # (n, H)
            grad_weight = (grad.t() @ hidden).to(weight.dtype)  # (V, H)
        grad_bias = None if bias is None else grad.sum(0).to(bias.dtype)  # (V,)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


def sampling_support(scaled_logits, top_k, top_p, tokens=None):
    """The tokens HF's sampler keeps after temperature, top-k, top-p: (b, T, V) bool, plus `tokens` (b, T) if given."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper
    flat = scaled_logits.reshape(-1, scaled_logits.shape[-1])  # (b*T, V)
    if top_k > 0:
        flat = TopKLogitsWarper(top_k)(None, flat)
    if top_p < 1.0:
        flat = TopPLogitsWarper(top_p)(None, flat)
    support = (flat > -math.inf).view(scaled_logits.shape)  # (b, T, V)
    if tokens is not None:
        support.scatter_(-1, tokens.unsqueeze(-1), True)  # (b, T, V): the drawn token is always in
    return support


def dense_support(keep, n, V):
    """(n, V) bool from (position, token) pairs; a position with no pair (padding) keeps every token."""
    support = torch.zeros(n, V, dtype=torch.bool, device=keep[0].device)
    support[keep] = True
    return support | ~support.any(-1, keepdim=True)


def pack_support(positions, tokens, n):
    """Pairs over n positions, packed by position: offsets (n+1,) and token ids (N,), int32."""
    offsets = torch.zeros(n + 1, dtype=torch.long, device=positions.device)
    offsets[1:] = torch.bincount(positions, minlength=n).cumsum(0)
    return offsets, tokens[positions.argsort(stable=True)].int()


def kept_pairs(packed, rows, t, T):
    """The pairs of positions 0..t-1 of `rows` (b,) of a packed (B, T) support, numbered 0..b*t-1 in that order."""
    offsets, tokens = packed
    positions = (rows[:, None] * T + torch.arange(t, device=rows.device)).flatten()  # (b*t,)
    start, count = offsets[positions], offsets[positions + 1] - offsets[positions]  # (n,) each
    seg = torch.repeat_interleave(torch.arange(len(positions), device=start.device), count)  # (N,)
    first = torch.repeat_interleave(start - (count.cumsum(0) - count), count)  # (N,): start - pairs before it
    return seg, tokens[first + torch.arange(len(seg), device=start.device)].long()


def chunked_head_works(model, device):
    """Whether the chunked head's logits = head(last hidden state) (Gemma 2: capped) are the model's: 8 tokens."""
    ids = torch.arange(2, 10, device=device)[None] % model.config.vocab_size  # (1, 8)
    with torch.no_grad():
        plain = policy_logprobs(model, ids, torch.ones_like(ids), 4, 1.0)[0]  # (1, 4)
        chunked = policy_logprobs(model, ids, torch.ones_like(ids), 4, 1.0, chunk=3)[0]  # (1, 4)
    return torch.allclose(plain, chunked, atol=1e-4)


def packed_forward(model, query_responses, position_ids, real, logits_to_keep, **kw):
    """`forward` on the rows' real tokens (pack_rows); a pre-hook on the head lays its input out as rows again, so
    the head, the critic's score and everything after them see what the padded forward gives."""
    ids, positions, where = pack_rows(query_responses, position_ids, real)  # (n, L) each; where: (N,)

    def unpack(head, inputs):  # (n, L, H) -> (b, P+T, H): each real token's state back in its row, 0 on padding
        rows = inputs[0].new_zeros(*real.shape, inputs[0].shape[-1]).index_put((real,), inputs[0].flatten(0, 1)[where])
        return (rows[:, -logits_to_keep:],)  # (b, keep, H): the last positions, as logits_to_keep (0: all)
    hook = (model.seq_cls.score if isinstance(model, ValueModel) else model.get_output_embeddings()
            ).register_forward_pre_hook(unpack, prepend=True)  # (before head_states' hook)
    try:
        return model(input_ids=ids, position_ids=positions, use_cache=False, **kw)
    finally:
        hook.remove()


def pack_rows(query_responses, position_ids, real):
    """The rows' real tokens (contiguous in each row: left-padded prompts, right-padded responses) end to end, in
    lines no longer than the longest row (first fit, longest first: no line attends over more than a padded row
    would). Positions restart at each row, so transformers keeps attention within it (sdpa, eager, flex: a mask from
    the positions; flash-attention: varlen); a line's padded tail sits at position 0, rows of its own. Returns the
    ids and positions (n, L) and where each real token (row-major) went in the lines, flattened (N,)."""
    counts = real.sum(1)  # (b,)
    n, width, fill, start = counts.tolist(), int(counts.max()), [], [0] * len(counts)
    for r in sorted(range(len(n)), key=lambda r: -n[r]):
        i = next((i for i, f in enumerate(fill) if f + n[r] <= width), len(fill))
        fill += [0] * (i == len(fill))
        start[r], fill[i] = i * width + fill[i], fill[i] + n[r]
    row = torch.repeat_interleave(torch.arange(len(counts), device=real.device), counts)  # (N,): each token's row
    first = torch.cumsum(counts, 0) - counts  # (b,): each row's first token in the row-major order
    where = torch.tensor(start, device=real.device)[row] + torch.arange(len(row), device=real.device) - first[row]
    ids = query_responses.new_zeros(len(fill) * width).index_put((where,), query_responses[real])  # (n*L,)
    positions = position_ids.new_zeros(len(fill) * width).index_put((where,), position_ids[real])  # (n*L,)
    return ids.view(len(fill), width), positions.view(len(fill), width), where


def packing_works(model, device):
    """Whether a model's packed forward is its padded one (its `pack` then set): attention kept within each row, as
    transformers builds it from the positions (else: padded). Three rows of 6, 3 and 3 tokens: two lines."""
    ids = (torch.arange(18, device=device).view(3, 6) * 7 + 2) % getattr(model, "seq_cls", model).config.vocab_size
    mask = torch.ones_like(ids)  # (3, 6)
    mask[1:, :2] = mask[1:, 5] = 0  # prompts left-padded, responses right-padded
    out, value = [], isinstance(model, ValueModel)
    for model.pack in (False, True):
        with torch.no_grad():  # the last 3 positions' logits (3, 3, V), or values (3, 3, 1)
            y = forward(model, ids, mask, logits_to_keep=0 if value else 3)
            out.append(y[:, 3:, None] if value else y.logits)
    model.pack = torch.allclose(*(x * mask[:, 3:, None] for x in out), atol=1e-4)  # (else its passes run padded)
    return model.pack


# --- sampling: each row from its own random stream; where a response stops --------------------
class KeyedSampler(transformers.LogitsProcessor):
    """HF's sampling (temperature, top-k, top-p), each row on its own random stream: a generator seeded by the row's
    key draws its uniforms, and each step takes the token at which the cumulative sum of the filtered distribution
    passes the step's uniform (inverse-CDF sampling); the scores become that token's one-hot, for greedy decoding to
    take. A row's tokens thus depend on its key and the weights alone, not on its rank or its batch. Keeps log p of
    each drawn token on the support it was drawn from (what --keep-sampling-mask scores), the sampler's log-probs."""
    def __init__(self, keys, sampling, device):
        steps = sampling.max_new_tokens or sampling.max_length
        self.uniform = torch.stack([torch.rand(steps, generator=torch.Generator(device).manual_seed(k), device=device,
                                               dtype=torch.float64) for k in keys])  # (B, steps)
        self.sampling, self.taken = sampling, []

    def __call__(self, input_ids, scores):
        tau, top_k, top_p = self.sampling.temperature, self.sampling.top_k or 0, self.sampling.top_p or 1.0
        logits = scores.float() / tau  # (B, V)
        logits = logits.masked_fill(~sampling_support(logits, top_k, top_p), -math.inf)  # (B, V): the kept support
        cdf = torch.softmax(logits.double(), -1).cumsum(1)  # (B, V): float32's would give a 152k tail no width
        u = self.uniform[:, len(self.taken), None] * cdf[:, -1:]  # (B, 1): below the sum, however it rounded
        token = torch.searchsorted(cdf, u, right=True).squeeze(1)  # (B,): the first token whose cdf passes u
        self.taken.append(torch.log_softmax(logits, -1).gather(1, token[:, None]))  # (B, 1)
        return torch.full_like(scores, -math.inf).scatter_(1, token[:, None], 0.0)  # (B, V)

    def logprobs(self):
        return torch.cat(self.taken, 1)  # (B, T)


def response_lengths(responses, stop_ids):
    """Valid tokens per row: up to and including the first stop token (an EOS), or all T when there is none."""
    T = responses.shape[1]
    is_eos = torch.isin(responses, torch.as_tensor(stop_ids, device=responses.device))  # (B, T)
    first_eos = is_eos.int().argmax(1)  # (B,): 0 when there is no EOS, hence the where below
    return torch.where(is_eos.any(1), first_eos + 1, T)  # (B,)


# --- vLLM rollouts ----------------------------------------------------------------------------
# An engine in this process samples; PPO's old log-probs stay the trainer's unless --old-logprobs (docs/vllm.md).
def start_vllm(args, models, device):
    """The engine, built from the initial checkpoint, fed the current weights (--resume); None without --vllm."""
    if not args.vllm:
        return None
    llm = adapters.vllm_engine(models.policy_path, models.policy.config, args, device)
    push_weights(llm, models.policy)
    return llm


def push_weights(llm, model, wake=False):
    """Phase 9: the model's weights into the engine, tensor by tensor; wake: the engine slept through phase 7."""
    from torch.distributed.tensor import DTensor
    if wake:
        torch.cuda.empty_cache()  # the engine allocates outside torch's cache
        llm.wake_up(tags=["weights"])
    weights = ((k, v.detach().full_tensor() if isinstance(v, DTensor) else v.detach())  # not the state dict (Gemma2)
               for k, v in model.named_parameters())
    if lora_layers(model):  # LoRA: W + scale * B A per tensor, as the engine reads it (merged serving is faster
        weights = adapters.merged(weights, lora_layers(model))  # than serving adapters: TRL #7017, 1.33-1.39x a token)
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})  # the one call into vLLM internals
    if not torch.cuda.is_available():
        llm.apply_model(adapters.repack_cpu_kernels)
    if wake:
        llm.wake_up(tags=["kv_cache"])


# --- --async-steps: generation beside training ---------------------------------------------
def Sampler(policy, tokenizer, args, device, ready=None):
    """A second process draws update u+1's batch with the weights after update u-1 while update u trains (AReaL's
    one-step staleness); its plumbing is asyncsampler.py's. `ready` is one drawn ahead (a checkpoint's)."""
    import asyncsampler
    return asyncsampler.Sampler(policy, tokenizer, args, device, ready, draw, prompt_order, fail)


def draw(policy, tokenizer, prompt_ids, args, update, device):
    """--async-steps' phase 1 (`generate`), each row on the random stream of its key: the same in any process."""
    with forward_autocast(args, device):
        return generate(policy, tokenizer, prompt_ids, device, sampler=sampler_autocast(args, device),
                        keys=row_keys(args, update, 1, 0, len(prompt_ids)))


def sampler_autocast(args, device):
    """The HF sampler's autocast, in which `generate` keeps its log-probs; None: not kept, as no update reads them."""
    if args.vllm or (args.sampler_precision == "auto" and args.old_logprobs == "recompute" and not args.async_steps):
        return None  # (vLLM: its own precision, its log-probs always kept)
    return contextlib.nullcontext() if args.sampler_precision == "auto" else torch.autocast(  # (auto: --precision)
        device.type, dtype=HALF.get(args.sampler_precision), enabled=args.sampler_precision in HALF)


def forward_autocast(args, device):
    """--precision's autocast, around every forward: auto is bf16 on a GPU, fp32 on a CPU."""
    half = "bf16" if args.precision == "auto" and device.type == "cuda" else args.precision
    return torch.autocast(device.type, dtype=HALF.get(half), enabled=half in HALF)


# --- evaluation and logging -------------------------------------------------------------------
def metrics_row(update, args, rollout, stats, epoch_clipfrac, health, skipped_steps, kl_coef, lr, times,
                score_parts, gold, tokenizer):
    """Phase 10: the update's metrics under the N+ / TRL names (docs/metrics.md's table), on this rank."""
    device, mask, lengths = rollout.mask.device, rollout.mask, rollout.lengths
    scores, non_score_reward, returns = rollout.scores, rollout.non_score_reward, rollout.returns
    stats = {k: global_sum(torch.tensor(v, dtype=torch.float64, device=device)).item() for k, v in stats.items()}
    n = max(stats["tokens"], 1)  # (0 when --overlong-filter dropped every response: nothing was trained)
    explained_variance = 1 - masked_var(returns - rollout.values, mask) / masked_var(returns, mask).clamp(min=1e-8)
    P = rollout.query_responses.shape[1] - mask.shape[1]  # phase 3's micro-batches as --no-pack pads them: each row
    padded = sum(len(r) * (P + int(lengths[r].max())) for r in micro_batches(  # at their longest prompt and response
        lengths, P, args.micro_batch_size or len(lengths) // args.num_minibatches, args.micro_batch_tokens))
    row = {"step": update, "episode": update * args.batch_size, "objective/scores": scores.mean().item(),
           **({} if no_reference(args) else {  # (beta 0: no reference was run, so no KL to report)
               "objective/kl": rollout.kl.sum(1).mean().item(),  # --kl-estimator's, summed over each response
               # the KL to the reference as k1 estimates it, whatever --kl-estimator is: comparable across estimators
               "objective/kl_k1": ((rollout.logprobs - rollout.ref_logprobs) * mask).sum(1).mean().item()}),
           **({} if rollout.teacher_logprobs is None else {  # --teacher: the reverse KL to it, k1 summed a response
               "objective/distill_kl": ((rollout.logprobs - rollout.teacher_logprobs) * mask).sum(1).mean().item()}),
           **({"ppo/loss/distill_avg": stats["distill"] / n} if args.teacher and args.distill == "loss" else {}),
           "objective/kl_coef": kl_coef, "objective/non_score_reward": non_score_reward.sum(1).mean().item(),
           "objective/rlhf_reward": (scores + non_score_reward.sum(1)).mean().item(),
           # the tokens a pass saw (phase 3's, or epoch 0's where --old-logprobs skips it and --target-kl stops early)
           "objective/entropy": masked_mean(rollout.entropy.nan_to_num(), mask * rollout.entropy.isfinite()).item(),
           "ppo/policy/approxkl_avg": stats["approxkl"] / n, "ppo/policy/clipfrac_avg": stats["pg_clip"] / n,
           **{f"ppo/policy/clipfrac_epoch{k + 1}": c for k, c in enumerate(epoch_clipfrac)},
           "ppo/epochs": len(epoch_clipfrac), **health,
           "ppo/loss/policy_avg": stats["pg_loss"] / n, "ppo/loss/value_avg": stats["vf_loss"] / n,
           "ppo/val/clipfrac_avg": stats["vf_clip"] / n, "ppo/val/ratio": stats["ratio"] / n,
           "ppo/val/explained_variance": explained_variance.item(),
           "ppo/val/eos_rate": rollout.has_eos.float().mean().item(),
           "ppo/val/response_length": mask.sum(1).mean().item(),  # the agent's tokens
           "lr/actor": lr, "ppo/skipped_steps": skipped_steps, **times,
           "time/generated_tokens": global_sum(mask.sum().long()).item(), "time/trained_tokens": stats["tokens"],
           "time/padding_share": 1 - rollout.attention_mask.sum().item() / padded,  # what --pack's passes skip
           "mem/peak_mb": (torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda"  # per rank
                           else peak_rss_mb())}
    if rollout.engine_logprobs is not None and args.old_logprobs != "sampler":  # (sampler: no trainer's to compare;
        # ppo/policy/ratio_at_start is then the gap) how far the sampler's log-probs are from the trainer's
        log_ratio = (rollout.logprobs - rollout.engine_logprobs) * mask  # (B, T): log p_trainer / p_sampler
        ratio = torch.exp(log_ratio)  # (B, T)
        row.update({"rollout/logprob_diff_mean": masked_mean(log_ratio.abs(), mask).item(),
                    "rollout/logprob_diff_max": log_ratio.abs().max().item(),
                    "rollout/kl": masked_mean(-log_ratio, mask).item(),  # KL(sampler || trainer), k1 (veRL's)
                    "rollout/prob_ratio_mean": masked_mean(ratio, mask).item(),
                    "rollout/prob_ratio_max": ratio.masked_fill(mask == 0, 0).max().item(),
                    "rollout/prob_ratio_min": ratio.masked_fill(mask == 0, math.inf).min().item()})
    if rollout.corrected is not None:  # the share of tokens and of responses that --rollout-correction changed
        row.update({"rollout/corrected_tokens": masked_mean(rollout.corrected, mask).item(),
                    "rollout/corrected_responses": rollout.corrected.amax(1).mean().item(),
                    "rollout/is_weight_mean": masked_mean(rollout.is_weights, rollout.kept).item()})
    if args.tools:  # calls per episode since the last row (tools.py, imported by load_models)
        row.update(sys.modules["tools"].counts("tools/"))
    if args.env is not None or args.tools:  # turns per episode (the env's steps), and per success
        turns = rollout.turn_ends.sum(1)  # (B,)
        ended = rollout.has_eos.float()  # (B,): sums over all ranks, whose counts of ended episodes differ
        n_ended, turns_ended = global_sum(torch.stack([ended.sum(), (turns * ended).sum()])).tolist()
        row.update({"env/turns": turns.mean().item(),  # (means of equal shares: reduce_row's mean is right)
                    "env/turns_when_ended": turns_ended / n_ended if n_ended else float("nan"),
                    "env/episode_tokens": lengths.float().mean().item()})
    for name, part in score_parts.items():  # each weighted component of the score
        row[f"objective/{name}"] = part.mean().item()
    if gold is not None:  # the toy judge reads the EOS token too
        responses = rollout.query_responses[:, -mask.shape[1]:]  # (B, T): the last T columns
        row["objective/gold"] = float(np.mean([gold(tokenizer.decode(r[: int(k)]))
                                               for r, k in zip(responses, lengths)]))
    return row


def peak_rss_mb():
    """This process's peak resident memory: Linux's VmHWM (a child keeps its parent's ru_maxrss across exec)."""
    for line in open_or_empty("/proc/self/status").splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 / (1024 if sys.platform == "darwin" else 1)


def evaluate(update, args, models, eval_rows, eval_ids, local_batch, micro, amp, device, llm):
    """Evaluation responses (--eval-samples k each), scored like the rollouts: eval/ metrics and a few sample rows."""
    rank, world = rank_and_world()
    share, k = eval_share(len(eval_ids), rank, world), args.eval_samples
    mine = [j for j in share if j is not None]  # the prompts this rank counts
    rows = [len(eval_ids) - 1 if j is None else j for j in share for _ in range(k)]  # each prompt k times, side by side
    counted = [j is not None for j in share for _ in range(k)]  # (rows,)
    # random streams of their own, keyed by (seed, update, prompt, try): with or without evaluation, a run trains
    # the same, and on any number of ranks it evaluates the same
    keys = row_keys(args, update, 2, 0, len(eval_ids) * k)
    keys = [keys[j * k + t] for j in rows[::k] for t in range(k)]
    sums, samples, passed = {}, [], []
    seeds = evaluation_seeds(args, len(eval_ids)) if models.env else None
    if seeds is not None:  # a prompt's k tries play the same episode
        seeds = [seeds[j] for j in rows]
    for i in range(0, len(rows), local_batch):
        idx, counts = rows[i: i + local_batch], torch.tensor(counted[i: i + local_batch], device=device)  # (b,) each
        tries = None if seeds is None else seeds[i: i + local_batch]  # --env: these episodes' seeds
        batch = sample(models, args, eval_rows, eval_ids, idx, tries, micro, amp, device, llm, args.eval_greedy,
                       keys=keys[i: i + local_batch])
        qr, lengths, has_eos, P, texts = batch.query_responses, batch.lengths, batch.has_eos, batch.P, batch.texts
        total, parts = batch.scores, batch.score_parts
        responses = [r[: int(n)] for r, n in zip(qr[:, P:], lengths)]
        if args.missing_eos_penalty is not None:
            total = torch.where(has_eos, total, args.missing_eos_penalty)
        values = {"eval/score": total, **{f"eval/{name}": v for name, v in parts.items()}}
        if models.gold is not None:
            values["eval/gold"] = torch.tensor([models.gold(models.tokenizer.decode(r)) for r in responses])
        for name, v in values.items():
            sums[name] = sums.get(name, 0.0) + v[counts.to(v.device)].sum().item()
        passed += (total >= args.pass_threshold)[counts].tolist()
        firsts = models.tokenizer.batch_decode(qr[:, :P], skip_special_tokens=True)  # --env: the prompt
        samples += [{"step": update, "prompt": eval_rows[j]["prompt"] if models.env is None else firsts[n],
                     "response": t, "score": s} for n, (j, t, s) in enumerate(zip(idx, texts, total.tolist()))
                    if counts[n]][: max(0, 8 - len(samples))]
    right = np.array(passed, dtype=int).reshape(len(mine), k).sum(1)  # (prompts,): how many of its k passed
    pass_sums = torch.tensor([sum(pass_at_k(k, int(c), j) for c in right) for j in range(1, k + 1)],
                             dtype=torch.float64, device=device)  # (k,): exact, not float32's 7 digits
    n_responses, n_prompts = global_sum(torch.tensor([float(len(mine) * k), float(len(mine))], device=device)).tolist()
    row = {name: global_sum(torch.tensor(v, dtype=torch.float64, device=device)).item() / max(n_responses, 1)
           for name, v in sums.items()}
    row.update({f"eval/pass@{j + 1}": v / max(n_prompts, 1) for j, v in enumerate(global_sum(pass_sums).tolist())})
    if args.tools:  # the evaluation's calls per episode, kept out of the next update's tools/
        row.update(sys.modules["tools"].counts("eval/tools/"))
    return row, samples


def eval_share(n, rank, world):
    """This rank's share of n evaluation prompts: rank, rank + N, ...; equal shares, as every rank joins each forward,
    a rank short of prompts filling its own with None (evaluated as the last prompt, not counted)."""
    return [j if j < n else None for j in range(rank, -(-n // world) * world, world)]


def evaluation_seeds(args, n):
    """Each evaluation prompt's episode seed, the same at every update, on any ranks (a key no training key equals)."""
    return [int(s) for s in np.random.SeedSequence([args.seed, 2**32 - 1]).generate_state(n)]


def pass_at_k(n, c, k):
    """1 - C(n-c, k) / C(n, k): unbiased pass@k from n samples of which c passed (Chen et al. 2021), exact."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def open_run(args, run_name, run_dir, first_update):
    """Rank 0: the rows after the resumed checkpoint dropped, config.json written, metrics.jsonl (and wandb) opened."""
    rank, world = rank_and_world()
    if rank == 0:
        lock_run(run_dir)  # a fresh run's folder is made (and locked) only now, when everything has loaded
        if args.resume is None:  # refused, should another process have started a run of this name meanwhile
            choose_checkpoint(args, run_dir, print)
        elif args.resume != "auto":  # an explicit earlier step starts a new branch: the old one's later steps go
            for later in reversed(list_checkpoints(os.path.join(run_dir, "checkpoints"))):
                if int(os.path.basename(later)[5:]) >= first_update:
                    discard(later)
            best_json = os.path.join(run_dir, "best", "best.json")
            if os.path.exists(best_json) and json.load(open(best_json))["step"] >= first_update:
                discard(os.path.dirname(best_json))  # the best/ of the abandoned branch: the new one starts without
        for name in ("metrics.jsonl", "samples.jsonl", "eval_samples.jsonl"):
            truncate_jsonl(os.path.join(run_dir, name), first_update - 1)
    if world > 1:
        dist.barrier()  # every rank has read the old files before rank 0 writes
    if rank != 0:
        return None
    write_json(os.path.join(run_dir, "config.json"), dict(asdict(args), world_size=world))
    if args.track:
        import wandb
        wandb.init(project=args.wandb_project, name=run_name, config=asdict(args), dir=run_dir,
                   id=re.sub(r"[^\w-]", "-", run_name), resume="allow")
    return open(os.path.join(run_dir, "metrics.jsonl"), "a")


def json_line(row):
    """One JSON line; a NaN or inf becomes null (bare NaN is not JSON, and strict readers reject it)."""
    return json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}) + "\n"


def keep_best_value(row, args):
    """This row's --keep-best metric (-inf on updates without evaluation); refused if the run never logs it."""
    if args.keep_best in row:
        return row[args.keep_best]
    if args.keep_best.startswith("eval/") and "eval/score" not in row:
        return -math.inf
    fail(f"--keep-best {args.keep_best!r} is not a metric of this run: name a key of metrics.jsonl, e.g. eval/score")


def write_logs(args, run_dir, metrics_file, bar, row, samples, eval_samples):
    """Rank 0: the metrics row, a console line, the sample rows, and their wandb mirror."""
    metrics_file.write(json_line(row))
    metrics_file.flush()
    bar.set_postfix(score=f"{row['objective/scores']:.2f}")
    tqdm.write(f"update {row['step']:4d}  score {row['objective/scores']:+.3f}  "
               + (f"kl {row['objective/kl']:.3f}  " if "objective/kl" in row else "")  # (beta 0: none)
               + (f"gold {row['objective/gold']:.3f}  " if "objective/gold" in row else "")
               + f"clipfrac {row['ppo/policy/clipfrac_avg']:.3f}  len {row['ppo/val/response_length']:.1f}  "
               f"{row['time/rollout_s'] + row['time/update_s']:.2f}s")
    for name, rows in (("samples", samples), ("eval_samples", eval_samples)):
        if rows:
            with open(os.path.join(run_dir, f"{name}.jsonl"), "a") as f:
                f.writelines(json_line(r) for r in rows)
    if args.track:
        import wandb
        wandb.log(row, step=row["step"])
        for name, rows in (("samples", samples), ("eval/samples", eval_samples)):
            if rows:
                wandb.log({name: wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])},
                          step=row["step"])


def run_summary(args, run_dir, seconds):
    """What a finished run prints last: its headline figure, first and over the last 10, and the files it wrote."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    key, name = (("objective/gold", "gold") if "objective/gold" in rows[0] else
                 ("objective/reward_fn", "accuracy") if args.model == "chain" else
                 ("ppo/val/eos_rate", "success") if args.model == "guess" else ("objective/scores", "score"))
    last = [r[key] for r in rows[-10:]]
    out = [f"done in {seconds:.0f} s: {name} {rows[0][key]:.2f} at update {rows[0]['step']}, {np.mean(last):.2f} "
           f"over the last {len(last)} (of {rows[-1]['step']})"]
    if no_reference(args):
        out.append("  no KL metrics: at --kl-coef 0 no reference was loaded or run (--unread-reference runs it)")
    for path, what in (("metrics.jsonl", "one row per update (docs/metrics.md explains them)"),
                       ("samples.jsonl", "prompts, responses and their scores, every --sample-every updates"),
                       ("eval_samples.jsonl", "the evaluation's responses"), ("policy", "the trained policy"),
                       ("policy_adapter", "its LoRA adapters"), ("critic", "the trained critic (the value model)"),
                       ("best", "the models of the best update (--keep-best)")):
        if os.path.exists(os.path.join(run_dir, path)):
            out.append(f"  {os.path.join(run_dir, path):<44} {what}")
    return "\n".join(out)


def close_run(args, metrics_file, run_dir):
    if metrics_file is not None:
        metrics_file.close()
        if args.track:
            import wandb
            wandb.finish()
    unlock_run(run_dir)
    for s, handler in PREVIOUS_HANDLERS.items():  # Ctrl-C means KeyboardInterrupt again
        signal.signal(s, handler)


# --- checkpoints and resume -------------------------------------------------------------------
def save_models(path, models):
    """Policy (with its tokenizer) and critic, gathered by every rank, written by rank 0 in the dtypes they came in."""
    policy, critic = models.policy, models.critic
    policy_state, critic_state = full_state_dict(policy), critic and full_state_dict(critic)
    if rank_and_world()[0] == 0:
        critic_state = critic_state and {k.removeprefix("seq_cls."): v for k, v in critic_state.items()}
        for name, model, state, dtype, base in (
                ("policy", policy, policy_state, models.stored_dtypes[0], models.policy_path),
                ("critic", critic and critic.seq_cls, critic_state, models.stored_dtypes[1], models.critic_path)):
            if model is None:
                continue
            if lora_layers(model):  # LoRA: the adapters in peft's format (what resume reads), and W + scale * B A
                adapters.save_adapter(model, os.path.join(path, f"{name}_adapter"), base,
                                      "score" if name == "critic" else None, state)  # (FSDP2: the gathered state)
                state = dict(adapters.merged((state or model.state_dict()).items(), lora_layers(model)))
                dtype = torch.float32  # W + s B A: cast to a bf16 checkpoint's dtype, the update would round away
            save_in_dtype(model, os.path.join(path, name), state, dtype)
        models.shipped_generation_config.save_pretrained(os.path.join(path, "policy"))  # not the run's sampler
        models.shipped_tokenizer.save_pretrained(os.path.join(path, "policy"))


def save_in_dtype(model, path, state, dtype):
    """save_pretrained of the weights cast to `dtype` (a copy), refused if any is not finite after the cast."""
    state, cast = state or model.state_dict(), {}  # one copy per tensor, so a tied head stays the embedding's alias
    state = {k: cast.setdefault((v.data_ptr(), v.shape, v.stride()), v.to(dtype)) if v.is_floating_point() else v
             for k, v in state.items()}  # (--lora-base-dtype bf16 bases among fp32 weights: all of them `dtype`)
    if not all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point()):
        fail(f"the {os.path.basename(path)} has non-finite weights; refusing to save them to {path}")
    model.save_pretrained(path, state_dict=state)
    fp32, model.config.dtype = model.config.dtype, dtype  # config.json names the dtype of the weights saved
    model.config.save_pretrained(path)  # (save_pretrained names the model's own, fp32)
    model.config.dtype = fp32


def save_checkpoint(args, run_dir, update, models, optimizers, schedulers, scaler, kl_coef, best, device, drawn=None):
    """step_<update>/: each rank writes its shards of the trained weights and of AdamW's states (torch.distributed.
    checkpoint, which any number of ranks reads back), rank 0 the loop's counters; aside, then renamed into place (a
    kill leaves every other checkpoint whole); the newest few kept. No process holds more than its own shards."""
    import torch.distributed.checkpoint as dcp
    rank, world = rank_and_world()
    ckpt_root = os.path.join(run_dir, "checkpoints")
    final = os.path.join(ckpt_root, f"step_{update}")
    tmp = final + ".tmp"
    shards = trained_state(models, optimizers)  # (FSDP2: each rank checks its own shards; all stop together)
    local = [getattr(x, "to_local", lambda: x)() for x in torch.utils._pytree.tree_leaves(shards) if torch.is_tensor(x)]
    if global_sum(sum((~x.isfinite()).sum() for x in local if x.is_floating_point()).to(device)) > 0:
        fail(f"update {update}: the weights or AdamW's moments hold NaN or inf; no checkpoint written, the earlier "
             "ones are intact: lower the learning rates, then resume from one")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    if world > 1:
        dist.barrier()  # (no rank writes into the folder before rank 0 has cleared it)
    try:
        dcp.save(shards, checkpoint_id=os.path.join(tmp, "shards"))
        if rank == 0:
            torch.save(dict(step=update, kl_coef=kl_coef, best=best, world=world, drawn=drawn, scaler=scaler and
                            scaler.state_dict(), schedulers=[sch.state_dict() for sch in schedulers]),
                       os.path.join(tmp, "state.pt"))
            write_json(os.path.join(tmp, "flags.json"), asdict(args))  # what resume compares
        own = lambda rel: re.fullmatch(rf"shards/__{rank}_\d+\.distcp", rel) or rank == 0 and rel[-7:] != ".distcp"
        digests = [file_digests(tmp, own)] * world  # each rank checksums its own files, in parallel
        if world > 1:
            dist.all_gather_object(digests, digests[0])
        if rank == 0:
            write_json(os.path.join(tmp, "manifest.json"), {k: v for d in digests for k, v in d.items()})  # last
    except (OSError, RuntimeError, dcp.api.CheckpointException) as e:  # (a full disk: "unexpected pos" from torch)
        shutil.rmtree(tmp, ignore_errors=True)
        full = shutil.disk_usage(ckpt_root).free < 2**20 or "unexpected pos" in str(e) or "No space" in str(e)
        fail(f"cannot write the checkpoint of update {update} to {ckpt_root}/: "
             f"{'no space left on the device' if full else reason(e)}; the earlier checkpoints are intact")
    if rank == 0:
        if os.path.exists(final):  # (a step of another branch; open_run discards them, a kill may have left one)
            discard(final)
        os.rename(tmp, final)
        for old in list_checkpoints(ckpt_root)[:-args.keep_checkpoints]:
            discard(old)
    if world > 1:
        dist.barrier()  # (the checkpoint in place before any rank goes on: a stop's message names it)


def trained_state(models, optimizers):
    """What a checkpoint shards: each trained model's weights that train (LoRA: the adapters and the value head)
    and its AdamW states, keyed by parameter names (FSDP2: this rank's shards, as DTensors)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    state = {}
    for name, model, opt in zip(("policy", "critic"), [m for m in (models.policy, models.critic) if m], optimizers):
        fresh = not opt.state  # never stepped (a critic warm-up, fp16's skipped steps): torch makes its states by a
        weights, state[f"{name}_adamw"] = get_state_dict(model, opt)  # step at lr 0, which counts as AdamW's step 1
        for moments in [*opt.state.values(), *state[f"{name}_adamw"]["state"].values()] if fresh else ():
            moments["step"].zero_()  # step 0 and zero moments: a fresh AdamW's, so its first real step is step 1
        training = {n for n, p in model.named_parameters() if p.requires_grad}
        state[name] = {k: v for k, v in weights.items() if k in training}
    return state


def find_run(args, rank, world, log):
    """The run's name, its folder and the checkpoint to resume from (None: a fresh run), as rank 0 decides, locked."""
    found = dict(name=args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}", resume=args.resume,
                 error=None)
    if rank == 0:
        try:
            found["resume"] = choose_checkpoint(args, os.path.join("runs", found["name"]), log)
        except UsageError as e:
            found["error"] = str(e)
    if world > 1:
        found = [found]
        dist.broadcast_object_list(found)
        found = found[0]
    if found["error"]:
        fail(found["error"])
    return found["name"], os.path.join("runs", found["name"]), found["resume"]


def choose_checkpoint(args, run_dir, log):
    """Rank 0: lock the run folder, clear what a killed save left, pick the checkpoint (runfiles.py's)."""
    try:
        return checkpoint_to_resume(asdict(args), run_dir, log)
    except ValueError as e:
        fail(str(e))


def restore(resume_dir, models, optimizers, schedulers, scaler, keep_best):
    """The trained weights and AdamW's states, resharded onto this run's ranks (any number), schedulers and
    counters; returns the KL coefficient, the next update, the best and --async-steps' batch drawn ahead."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    state = torch.load(os.path.join(resume_dir, "state.pt"), weights_only=True)  # every rank reads it
    shards = trained_state(models, optimizers)  # this rank's, to be filled in place
    try:
        dcp.load(shards, checkpoint_id=os.path.join(resume_dir, "shards"))
    except (RuntimeError, ValueError, KeyError, dcp.api.CheckpointException) as e:  # (the first rank's cause)
        cause = next(iter(e.failures.values())) if isinstance(e, dcp.api.CheckpointException) else e
        fail(f"{resume_dir} does not fit the models of these flags ({reason(cause)[:300]}): resume with the run's "
             "own --model and flags, or start a new --run-name")
    for name, model, opt in zip(("policy", "critic"), [m for m in (models.policy, models.critic) if m], optimizers):
        set_state_dict(model, opt, model_state_dict=shards[name], optim_state_dict=shards[f"{name}_adamw"],
                       options=StateDictOptions(strict=False))  # (strict: LoRA's frozen bases are not in it)
    for sched, sd in zip(schedulers, state["schedulers"]):
        sched.load_state_dict(sd)
    if scaler and state.get("scaler"):  # fp16's loss scale (a checkpoint of another precision: the default)
        scaler.load_state_dict(state["scaler"])
    best = state["best"]
    if json.load(open(os.path.join(resume_dir, "flags.json"))).get("keep_best") != keep_best:
        best = -math.inf  # the best so far was of another metric (--keep-best may change on resume)
    return state["kl_coef"], state["step"] + 1, best, state.get("drawn")


if __name__ == "__main__":
    args, code = tyro.cli(Args), 0
    try:
        main(args)
    except UsageError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except Stopped as e:
        print(f"stopped: {e}", file=sys.stderr)
        code = e.code
    sys.stdout.flush(), sys.stderr.flush()  # torchrun: out without the interpreter's teardown, where gloo's threads
    (os._exit if "RANK" in os.environ else sys.exit)(code)  # (kept by FSDP2's caches) abort now and then (CI saw it)
