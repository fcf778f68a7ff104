"""Memory of one PPO update on one 80 GB GPU for Qwen2.5-shaped 0.5B, 1.5B, 7B and 14B models: full
fine-tuning against LoRA rank 16, from exact parameter counts plus activation bytes per token measured
on one- and two-layer slices at the real sizes, on a CPU.

    python experiments/memory.py                  # all four sizes, under ~10 minutes on 2 CPU cores
    python experiments/memory.py --sizes 0.5B     # some of them

Prints the table as markdown and writes every figure to experiments/memory.json.

What it counts, and how:
- Parameters: each model built from its Qwen2Config on the meta device (no memory, no download),
  split into embeddings, head (if untied), the linear weights of a layer (q, k, v, o, gate, up, down:
  what LoRA adapts), the rest of a layer (norms, q/k/v biases) and the final norm. The critic and the
  reward model are sequence classifiers: the same body, no LM head, a one-output score head.
- Bytes per parameter on a GPU with --precision bf16. Full PPO: policy and critic trained, 16 B each
  (fp32 weights 4 + grads 4 + AdamW's two moments 8); reference and reward model frozen, their
  linear weights in bf16 (2 B; autocast casts them to bf16 before each matmul anyway) and embeddings,
  norms and head in fp32 (4 B). LoRA: the policy's and the critic's bases frozen as above, adapters
  r (in + out) per adapted linear at 16 B, the critic's value head trained whole (16 B); no reference
  copy (it is the policy with its adapters off); the reward model frozen as above.
- Activations: the bytes autograd saves for the backward, counted with saved_tensors_hooks (unique
  storages by data pointer; parameters and views of parameters left out) during one training forward
  of the policy (ppo.py's `policy_logprobs`, chunked head) and of the critic (`ValueModel`) with
  their PPO losses, under CPU bf16 autocast, gradient checkpointing off, on one- and two-layer slices
  at the real hidden, intermediate and vocabulary sizes. bf16 copies of weight matrices (autocast's
  casts, saved by the matmuls that use them) are counted apart: they are per step, not per token.
  Two lengths (1 row x 16 prompt tokens, 4 of them left padding, + 256 and + 512 response tokens);
  the slope is bytes per token, so constant terms drop out; per layer = slope(2 layers) -
  slope(1 layer), the rest (embedding, rotary tables, mask, head chunks, loss) = slope(1 layer) - per
  layer. A third length (1,024) on the one-layer slices checks that the bytes grow linearly, and the
  critic's one-layer slice is measured again with eager attention (which saves the (heads, T, T)
  probabilities) to show what a non-fused attention would add.
- The backward runs once per one-layer slice at the shortest length, under a dispatch mode that counts
  live tensor bytes (`LiveBytes`), to check that every trained tensor gets a gradient and to measure
  the backward's transient: the peak of live tensor bytes above those alive at the forward's end
  (the head's chunks: logits, their gradient, the head weight's gradient and bf16 copies). Each
  gradient is dropped once accumulated, as if .grad already held it (its 4 B are in the 16 B).
- AdamW's step transient: torch's foreach AdamW (the CUDA default; a CPU defaults to the per-tensor
  loop) keeps one temporary sqrt(v) of every parameter of the group: measured on a small slice.

The table then adds, at ROWS x ROW_TOKENS tokens per micro-batch: weights and optimizer states;
policy + critic activations (both held at the one backward of their summed loss); the saved bf16
weight copies; the backward's transient; AdamW's (the activations are gone by the step, so the peak
is the larger of the two); and a vLLM engine's bf16 copy of the policy (weights only, not its KV
cache) in a row of its own. A model fits if its peak is under 90% of 80 GB (the rest for the CUDA
context, cuBLAS workspaces and allocator fragmentation, which a CPU cannot measure).
"""
import argparse
import json
import os
import sys
import time
import weakref
from functools import partial

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import ppo  # noqa: E402

HERE = os.path.join(ROOT, "experiments")

# Qwen2.5 base models' shapes (their config.json files); q, k, v carry biases in Qwen2
SIZES = {
    "0.5B": dict(hidden_size=896, num_hidden_layers=24, intermediate_size=4864, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5B": dict(hidden_size=1536, num_hidden_layers=28, intermediate_size=8960, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7B": dict(hidden_size=3584, num_hidden_layers=28, intermediate_size=18944, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "14B": dict(hidden_size=5120, num_hidden_layers=48, intermediate_size=13824, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK = 16
PROMPT, PAD = 16, 4  # prompt positions of the measured row, the first PAD of them left padding
LENGTHS = (256, 512)  # response tokens: the slope between them is bytes per token
CHECK_LENGTH = 1024  # a third length on the one-layer slices: is the growth linear?
ROWS, ROW_TOKENS = 8, 1024  # the table's micro-batch
GPU_BYTES, MARGIN = 80e9, 0.10  # "80 GB", 10% left for the CUDA context, workspaces and fragmentation
GB = 1e9


def qwen2_config(size, layers=None):
    return Qwen2Config(**{**SIZES[size], "num_hidden_layers": layers or SIZES[size]["num_hidden_layers"]},
                       rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=32768, num_labels=1)


# --- parameters -----------------------------------------------------------------------------------

def parameter_counts(size):
    """Exact counts from the config, on the meta device: the split the bytes model needs."""
    cfg = qwen2_config(size)
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        cls = AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32)
    layer = lm.model.layers[0]
    linear = sum(getattr(m, name).weight.numel() for m in (layer.self_attn, layer.mlp) for name in LINEAR
                 if hasattr(m, name))
    other = sum(p.numel() for p in layer.parameters()) - linear
    # adapters: A (r, in) and B (out, r) on every adapted linear
    lora = sum(RANK * (lin.in_features + lin.out_features) for m in (layer.self_attn, layer.mlp)
               for name in LINEAR if (lin := getattr(m, name, None)) is not None)
    c = dict(layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, vocab=cfg.vocab_size, tied=cfg.tie_word_embeddings,
             embed=lm.model.embed_tokens.weight.numel(),
             head=0 if cfg.tie_word_embeddings else lm.lm_head.weight.numel(),
             layer_linear=linear, layer_other=other, final_norm=lm.model.norm.weight.numel(),
             score=cls.score.weight.numel(), layer_lora=lora)
    c["policy"] = sum(p.numel() for p in lm.parameters())  # (tied: embed and head counted once)
    c["critic"] = sum(p.numel() for p in cls.parameters())
    body = c["embed"] + c["layers"] * (linear + other) + c["final_norm"]
    assert c["policy"] == body + c["head"] and c["critic"] == body + c["score"], (size, c)
    c["lora"] = c["layers"] * lora
    return c


def frozen_bytes(c, head):
    """A frozen model: adapted linear weights bf16, embeddings, norms, biases and head fp32."""
    return 2 * c["layers"] * c["layer_linear"] + 4 * (c["embed"] + c["layers"] * c["layer_other"]
                                                      + c["final_norm"] + head)


def state_bytes(c):
    """Weights and optimizer states on the GPU, per model, for full PPO and for LoRA."""
    full = dict(policy=16 * c["policy"], critic=16 * c["critic"],
                reference=frozen_bytes(c, c["head"]), reward_model=frozen_bytes(c, c["score"]))
    lora = dict(policy=frozen_bytes(c, c["head"]) + 16 * c["lora"],
                critic=frozen_bytes(c, 0) + 16 * (c["lora"] + c["score"]),
                reference=0, reward_model=frozen_bytes(c, c["score"]))
    return full, lora


# --- slices ---------------------------------------------------------------------------------------

def fill(model, tile):
    """Memory for a meta-built model, filled with a fixed random tile (norms 1): the values change
    nothing autograd saves, and drawing billions of random numbers takes minutes on 2 cores."""
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
                continue
            flat, n = p.view(-1), tile.numel()
            k = flat.numel() // n * n
            flat[:k].view(-1, n).copy_(tile)
            flat[k:].copy_(tile[:flat.numel() - k])
    return model


def build_slice(size, layers):
    """A `layers`-layer policy (causal LM, fp32) and its critic: a sequence classifier on the same body
    (same shapes as a critic of its own; sharing saves the host memory of a second copy)."""
    cfg = qwen2_config(size, layers)
    tile = torch.empty(1 << 20).uniform_(-0.03, 0.03, generator=torch.Generator().manual_seed(0))
    with torch.device("meta"):
        policy = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        critic = AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32)
    fill(policy, tile)
    if cfg.tie_word_embeddings:  # to_empty gave the head a parameter of its own: tie it again
        policy.lm_head.weight = policy.model.embed_tokens.weight
    policy.model.rotary_emb = Qwen2RotaryEmbedding(config=policy.config)  # its buffers, computed again
    critic.model = policy.model
    fill(critic.score, tile)
    return ppo.disable_dropout(policy), ppo.disable_dropout(critic)


def use_layers(policy, n):
    """Run the first n layers only (the body reads config.num_hidden_layers; critic's body is the policy's)."""
    policy.config.num_hidden_layers = n
    policy.config.layer_types = policy.config.layer_types[:1] * n


def to_lora(policy, critic):
    """ppo.py's adapters (rank RANK, all linear layers) in place, the adapted base weights then stored in
    bf16 as the frozen bases of the table are. The critic shares the adapted body; its trained set is
    what `add_lora(critic, head="score")` leaves: the adapters and the score head."""
    ppo.add_lora(policy, ppo.Args(lora_rank=RANK), "--model")
    for layer in ppo.lora_layers(policy).values():
        w = layer.base_layer.weight
        layer.base_layer.weight = nn.Parameter(w.detach().to(torch.bfloat16), requires_grad=False)
    for name, p in critic.named_parameters():
        p.requires_grad = ".lora_" in name or name.startswith("score.")


def batch(T, vocab):
    """One row: PROMPT prompt positions (the first PAD padding) and T response tokens."""
    g = torch.Generator().manual_seed(T)
    ids = torch.randint(0, vocab, (1, PROMPT + T), generator=g)  # (1, P+T)
    am = torch.ones_like(ids)
    am[:, :PAD] = 0
    return ids, am


def policy_pass(policy, T):
    """The policy's part of `minibatch_backward`: new log-probs (chunked head) and the clipped loss."""
    ids, am = batch(T, policy.config.vocab_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        new, _, _ = ppo.policy_logprobs(policy, ids, am, PROMPT, 0.7, False, None, chunk=ppo.Args().logprob_chunk)
    old = new.detach() + 0.01  # (1, T)
    mask = torch.ones_like(new)  # (1, T)
    new = torch.where(mask.bool(), new, old)
    losses, _, _, _ = ppo.policy_loss(new, old, torch.randn_like(new), 0.2)
    return (losses * mask / T).sum()


def critic_pass(critic, T):
    """The critic's part: values (`ValueModel`, `state_values`) and the clipped value loss."""
    ids, am = batch(T, critic.config.vocab_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        new = ppo.state_values(ppo.ValueModel(critic), ids, am, PROMPT)[:, :T]  # (1, T)
    old = new.detach() + 0.01
    losses, _ = ppo.value_loss(new, old, torch.randn_like(new), 0.2)
    return 0.1 * losses.sum() / T


def saved_tensors(run, model):
    """Run `run()` (a forward to a loss) counting what autograd saves: {kind: bytes} over unique
    storages, kind 'weight_copy' for low-precision copies of a weight matrix (autocast's casts, shaped
    like a parameter or its transpose), 'activation' for the rest; parameters themselves left out.
    Returns the loss (its graph alive) and the counts, and the list of saved tensors."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    shapes |= {s[::-1] for s in shapes}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in params and ptr not in seen:
            copy = t.dtype in (torch.bfloat16, torch.float16) and t.dim() == 2 and tuple(t.shape) in shapes
            seen[ptr] = ("weight_copy" if copy else "activation", st.nbytes(), str(t.dtype).replace("torch.", ""),
                         list(t.shape))
        return t.detach()  # (the tensor itself would tie a saved output to its own node: a cycle, leaked)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run()
    counts = {"activation": 0, "weight_copy": 0}
    for kind, nbytes, _, _ in seen.values():
        counts[kind] += nbytes
    return loss, counts, sorted(seen.values(), key=lambda s: -s[1])


class LiveBytes(TorchDispatchMode):
    """Live bytes of the tensor storages created under it (every op's outputs, the backward's too):
    `now` and `peak`, each storage counted from its creation until it is freed. A dispatch mode sees
    tensors, not the allocator: no caching, rounding or fragmentation (torch's MemTracker does the same,
    but refuses modules with frozen parameters)."""

    def __init__(self):
        super().__init__()
        self.seen, self.now, self.peak = WeakIdKeyDictionary(), 0, 0

    def _freed(self, nbytes, ref):
        self.now -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                if st not in self.seen:
                    n = st.nbytes()
                    self.seen[st] = weakref.ref(st, partial(self._freed, n))
                    self.now += n
        self.peak = max(self.peak, self.now)
        return out


def backward_transient(run, model, layers):
    """One forward and backward: the peak of live tensor bytes in the backward above those alive at the
    forward's end, and whether every trained tensor of the first `layers` layers (and outside them) got
    a gradient. Gradients are dropped as they are accumulated (a real step adds them into .grad,
    counted in the 16 B)."""
    got = set()

    def drop(p):
        got.add(id(p))
        p.grad = None
    trained = [p for name, p in model.named_parameters() if p.requires_grad
               and not any(f".layers.{i}." in name for i in range(layers, 64))]  # (the slice's unused layers)
    handles = [p.register_post_accumulate_grad_hook(drop) for p in trained]
    with LiveBytes() as live:
        loss = run()
        after_forward = live.peak = live.now
        loss.backward()
    for h in handles:
        h.remove()
    return dict(bytes=live.peak - after_forward, after_forward=after_forward,
                all_trained_got_gradients=all(id(p) in got for p in trained), trained_tensors=len(trained))


def adamw_step_transient(model):
    """Live bytes that torch's foreach AdamW (CUDA's default) adds during a step, per trained parameter:
    one step to create the moments, then the peak of the second."""
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-6, eps=1e-5, foreach=True)
    for p in trained:
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    with LiveBytes() as live:
        opt.step()
    n = sum(p.numel() for p in trained)
    for p in trained:
        p.grad = None
    opt.state.clear()
    return dict(bytes_per_trained_param=live.peak / n, trained_params=n)


def rss():
    """This process's resident memory now, bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def mem_available():
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))


def slope(a, b, ta, tb):
    return (b - a) / (tb - ta)


def measure_size(size, log):
    """Saved bytes of the policy and critic passes on 1- and 2-layer slices, full and LoRA."""
    t0 = time.perf_counter()
    policy, critic = build_slice(size, 2)
    log(f"{size}: slices built ({time.perf_counter() - t0:.0f} s), attention: {policy.config._attn_implementation}")
    out = dict(attn_implementation=policy.config._attn_implementation)
    passes = dict(policy=(policy_pass, policy), critic=(critic_pass, critic))
    for mode in ("full", "lora"):
        if mode == "lora":
            to_lora(policy, critic)
            out["lora_params_per_layer_measured"] = sum(
                p.numel() for n, p in policy.named_parameters() if ".lora_" in n) // 2
        res = out[mode] = {}
        for layers in ((2, 1) if mode == "full" else (1, 2)):
            use_layers(policy, layers)
            lengths = LENGTHS + ((CHECK_LENGTH,) if layers == 1 and mode == "full" else ())
            for name, (run, model) in passes.items():
                rows = {}
                for T in lengths:
                    loss, counts, listing = saved_tensors(lambda: run(model, T), model)
                    del loss
                    rows[T] = counts
                    if T == LENGTHS[0] and layers == 1:
                        res[f"{name}_saved_1layer_T{T}"] = listing
                res[f"{name}_{layers}layer"] = rows
                if layers == 1:  # one backward: gradients arrive; the backward's transient
                    # head: logits chunk, the weight's gradient and its copies; 14 B x V x H leaves a margin
                    need = 14 * SIZES[size]["vocab_size"] * SIZES[size]["hidden_size"] + 2 * GB
                    if mem_available() > need:
                        res[f"{name}_backward"] = backward_transient(lambda: run(model, LENGTHS[0]), model, 1)
                    else:
                        res[f"{name}_backward"] = f"not run: {mem_available() / GB:.1f} GB free, {need / GB:.1f} wanted"
                log(f"{size} {mode} {layers} layer(s) {name}: "
                    + ", ".join(f"T={T} {r['activation'] / 1e6:.1f} MB act + {r['weight_copy'] / 1e6:.1f} MB copies"
                                for T, r in rows.items()) + f" ({time.perf_counter() - t0:.0f} s)")
        if mode == "full":  # eager attention on the critic's one-layer slice: what T x T probabilities add
            use_layers(policy, 1)
            policy.set_attn_implementation("eager")
            eager = res["critic_1layer_eager"] = {T: saved_tensors(lambda: critic_pass(critic, T), critic)[1]
                                                  for T in LENGTHS + (CHECK_LENGTH,)}
            (t1, t2), t3 = LENGTHS, CHECK_LENGTH
            s1, s3 = (slope(eager[a]["activation"], eager[b]["activation"], a, b) for a, b in ((t1, t2), (t2, t3)))
            res["critic_1layer_eager_quadratic_bytes_per_T2"] = (s3 - s1) / (t3 - t1)
            res["critic_1layer_eager_slope_256_512"] = s1
            policy.set_attn_implementation(out["attn_implementation"])
    out["seconds"] = time.perf_counter() - t0
    return out


def per_token(m, name):
    """Bytes per token: per layer, rest; weight copies: per layer, rest (constants); linearity."""
    one, two = m[f"{name}_1layer"], m[f"{name}_2layer"]
    t1, t2 = LENGTHS
    s1 = slope(one[t1]["activation"], one[t2]["activation"], t1, t2)
    s2 = slope(two[t1]["activation"], two[t2]["activation"], t1, t2)
    c1, c2 = one[t1]["weight_copy"], two[t1]["weight_copy"]
    r = dict(per_layer=s2 - s1, rest=s1 - (s2 - s1), weight_copies_per_layer=c2 - c1,
             weight_copies_rest=c1 - (c2 - c1),
             weight_copies_constant=all(one[t]["weight_copy"] == c1 for t in one))
    if CHECK_LENGTH in one:  # a + bT + cT^2: c from the two slopes
        s3 = slope(one[t2]["activation"], one[CHECK_LENGTH]["activation"], t2, CHECK_LENGTH)
        r["slope_1layer_256_512"], r["slope_1layer_512_1024"] = s1, s3
        r["quadratic_bytes_per_T2"] = (s3 - s1) / (CHECK_LENGTH - t1)
    return r


def fit(usable, fixed, per_tok, tokens, step):
    """Peak at `tokens` tokens (the larger of the backward's and the optimizer step's), whether it fits,
    and the most tokens per micro-batch that fit (0: none)."""
    peak = max(fixed + per_tok * tokens, step)
    most = int((usable - fixed) // per_tok) if step <= usable and fixed < usable else 0
    return dict(peak=peak, fits=peak <= usable, tokens_that_fit=max(most, 0))


def table_columns(size, c, m):
    """Bytes of every row of the table for one size, full and LoRA."""
    tokens, usable = ROWS * ROW_TOKENS, (1 - MARGIN) * GPU_BYTES
    L = c["layers"]
    cols = {}
    for mode, state in zip(("full", "lora"), state_bytes(c)):
        res = m[mode]
        pt = {name: per_token(res, name) for name in ("policy", "critic")}
        act_tok = sum(p["rest"] + L * p["per_layer"] for p in pt.values())  # bytes per token, both models
        copies = sum(p["weight_copies_rest"] + L * p["weight_copies_per_layer"] for p in pt.values())
        bwd = [res[f"{n}_backward"]["bytes"] for n in ("policy", "critic") if isinstance(res[f"{n}_backward"], dict)]
        transient = max(bwd) if len(bwd) == 2 else 0  # (the larger of the two: they come one after the other)
        trained = max(c["policy"], c["critic"]) if mode == "full" else c["lora"] + c["score"]  # the larger optimizer
        adam = m["adamw_bytes_per_trained_param"] * trained
        weights = sum(state.values())
        col = cols[mode] = dict(state=state, weights_and_states=weights, per_token=pt,
                                activation_bytes_per_token=act_tok, activations=act_tok * tokens,
                                weight_copies=copies, backward_transient=transient if len(bwd) == 2 else None,
                                adamw_transient=adam, step_peak=weights + adam, vllm_weights=2 * c["policy"])
        col["backward_peak"] = weights + copies + transient + act_tok * tokens
        col.update(fit(usable, weights + copies + transient, act_tok, tokens, weights + adam))
        col["fits_with_vllm"] = col["peak"] + col["vllm_weights"] <= usable
        # --offload-frozen: the reference and the reward model in host memory during the update
        off = weights - state["reference"] - state["reward_model"]
        col["offload_frozen"] = fit(usable, off + copies + transient, act_tok, tokens, off + adam)
        # --gradient-checkpointing, estimated (not measured): each layer keeps its fp32 input (4 H B/token) and
        # the backward recomputes one layer at a time (its activations and weight copies, the policy's)
        ck_tok = sum(p["rest"] + L * 4 * c["hidden"] for p in pt.values()) + pt["policy"]["per_layer"]
        ck_fixed = sum(p["weight_copies_rest"] for p in pt.values()) + pt["policy"]["weight_copies_per_layer"] + transient
        col["checkpointing_estimate"] = dict(bytes_per_token=ck_tok, **fit(usable, weights + ck_fixed, ck_tok, tokens,
                                                                           weights + adam))
        col["offload_and_checkpointing_estimate"] = fit(usable, off + ck_fixed, ck_tok, tokens, off + adam)
    return cols


def markdown(columns, counts):
    sizes = list(columns)
    cells = [(s, k) for s in sizes for k in ("full", "lora")]
    head = f"| at {ROWS} x {ROW_TOKENS:,} tokens per micro-batch, GB | " + " | ".join(
        f"{s} {'full' if k == 'full' else 'LoRA'}" for s, k in cells) + " |"
    lines = [head, "|---" + "|---:" * len(cells) + "|"]

    def gb(v):
        return f"{v / GB:.1f}"

    def peak(f):
        return f"{f['peak'] / GB:.1f} yes" if f["fits"] else f"**{f['peak'] / GB:.1f} no**"

    def row(label, get, fmt=gb):
        lines.append(f"| {label} | " + " | ".join(fmt(get(columns[s][k], s)) for s, k in cells) + " |")
    row("parameters of the policy", lambda col, s: counts[s]["policy"], lambda v: f"{v / 1e9:.2f}B")
    row("policy (full: 16 B/param; LoRA: frozen base + adapters at 16 B)", lambda col, s: col["state"]["policy"])
    row("critic (full: 16 B/param; LoRA: its own base + adapters, value head)", lambda col, s: col["state"]["critic"])
    row("reference (frozen; LoRA: the policy, adapters off)", lambda col, s: col["state"]["reference"])
    row("reward model (frozen)", lambda col, s: col["state"]["reward_model"])
    row("**weights and optimizer states**", lambda col, s: col["weights_and_states"])
    row("activations, policy + critic (measured)", lambda col, s: col["activations"])
    row("bf16 weight copies saved for the backward (measured)", lambda col, s: col["weight_copies"])
    row("backward transient, head chunks (measured, 1 layer)", lambda col, s: col["backward_transient"],
        lambda v: "n/a" if v is None else gb(v))
    row("AdamW step: states + foreach temporary (measured)", lambda col, s: col["step_peak"])
    row(f"**peak; fits in {(1 - MARGIN) * GPU_BYTES / GB:.0f} GB (80 GB less {MARGIN:.0%})?**",
        lambda col, s: col, peak)
    row("tokens per micro-batch that fit", lambda col, s: col["tokens_that_fit"], lambda v: f"{v:,}" if v else "none")
    row("+ vLLM engine's bf16 policy (weights only, no KV cache)", lambda col, s: col["vllm_weights"])
    row("peak with it; fits?", lambda col, s: dict(peak=col["peak"] + col["vllm_weights"], fits=col["fits_with_vllm"]),
        peak)
    row("peak with --offload-frozen; fits?", lambda col, s: col["offload_frozen"], peak)
    row("peak with --gradient-checkpointing (estimate); fits?", lambda col, s: col["checkpointing_estimate"], peak)
    row("peak with both (estimate); fits?", lambda col, s: col["offload_and_checkpointing_estimate"], peak)
    row("tokens that fit with both (estimate)", lambda col, s: col["offload_and_checkpointing_estimate"]["tokens_that_fit"],
        lambda v: f"{v:,}" if v else "none")
    lines += ["", "| activation bytes per token (measured) | " + " | ".join(
        f"{s} {'full' if k == 'full' else 'LoRA'}" for s, k in cells) + " |", "|---" + "|---:" * len(cells) + "|"]
    for label, get in (("policy, per layer", lambda col: col["per_token"]["policy"]["per_layer"]),
                       ("policy, rest (embedding, mask, head chunks, loss)", lambda col: col["per_token"]["policy"]["rest"]),
                       ("critic, per layer", lambda col: col["per_token"]["critic"]["per_layer"]),
                       ("critic, rest", lambda col: col["per_token"]["critic"]["rest"]),
                       ("policy + critic, all layers", lambda col: col["activation_bytes_per_token"])):
        lines.append(f"| {label} | " + " | ".join(f"{get(columns[s][k]):,.0f}" for s, k in cells) + " |")
    return "\n".join(lines)


def findings(measured, counts, columns):
    """What the measurements say beyond the table, with their numbers, and what a CPU cannot tell."""
    out = []
    for s, m in measured.items():
        pol = columns[s]["full"]["per_token"]["policy"]
        heads = SIZES[s]["num_attention_heads"]
        out.append(
            f"{s}: attention {m['attn_implementation']}; bytes per token grow by {pol['quadratic_bytes_per_T2']:.1f} B "
            f"x T per row between T = {LENGTHS[0]}-{LENGTHS[1]} and {LENGTHS[1]}-{CHECK_LENGTH} (the bf16 (b, 1, T, T) "
            f"padding mask, saved once for all layers), no (heads, T, T) probabilities; eager attention saves "
            f"{m['full']['critic_1layer_eager_quadratic_bytes_per_T2']:.0f} B x T per token per layer "
            f"({m['full']['critic_1layer_eager_quadratic_bytes_per_T2'] / heads:.0f} B per head: fp32 softmax and "
            f"its bf16 copy), {m['full']['critic_1layer_eager_quadratic_bytes_per_T2'] * ROW_TOKENS / 1e3:,.0f} KB "
            f"per token per layer at {ROW_TOKENS:,}-token rows.")
        c = counts[s]
        out.append(
            f"{s}: the head's empty-input call (the pre-hook that lets the head run on nothing) still saves a bf16 "
            f"copy of the head weight, {columns[s]['full']['per_token']['policy']['weight_copies_rest']:,} B "
            f"(2 x V x H = {2 * c['vocab'] * c['hidden']:,}), with LoRA too (the frozen head's input needs a gradient); "
            f"the LoRA backward's transient ({m['lora']['policy_backward']['bytes'] / GB:.2f} GB, against "
            f"{m['full']['policy_backward']['bytes'] / GB:.2f} GB full) is mostly the frozen head weight's gradient, "
            f"which `HeadLogprobs.backward` computes and autograd then drops. Generation's bf16 KV cache: "
            f"{2 * c['layers'] * SIZES[s]['num_key_value_heads'] * c['hidden'] // SIZES[s]['num_attention_heads'] * 2:,} "
            f"B per token.")
    out += [
        "Not measurable here: a GPU's attention kernels (flash / memory-efficient SDPA save the output and a "
        "logsumexp per row and head, as the CPU flash kernel measured here does; a math fallback would save "
        "the T x T probabilities, see the eager figure); the caching allocator's reserved-but-unused blocks "
        "and fragmentation; the CUDA context (about 0.5-1 GB) and cuBLAS / cuDNN workspaces; NCCL buffers; "
        "the vLLM engine's KV cache (whatever share --vllm-gpu-memory-utilization gives it).",
        "Transients are live tensor bytes counted by a dispatch mode on 1-layer slices at 256 tokens: the "
        "head's chunk transient does not grow with depth; it is added here to every activation of both "
        "models and every weight copy, an upper bound (it comes at one moment of the backward, when some of "
        "them may already be freed).",
        "The rollout phase is not in the table: generation's KV cache (2 x layers x kv heads x head dim x 2 B per "
        "token in bf16) and the no-grad passes of all four models; the update's peak is what the table shows.",
        "Activation bytes per token count every token as a response token (the head's chunks run on response "
        "tokens only) and hold for any rows x tokens split; the T x T mask term adds 2 x T B per token.",
        "ppo.py today loads every model in fp32 (docs/lora.md: a bf16 frozen base is not there yet): the frozen rows "
        "would be 4 B/param, and an fp32 frozen base under autocast also saves a bf16 copy of every adapted "
        "weight for the backward (as the full-PPO row of weight copies does).",
        "The --gradient-checkpointing rows are estimates, not measurements: 4 H B/token per layer (each "
        "layer's fp32 input) plus one layer's measured activations recomputed in the backward.",
    ]
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=",".join(SIZES), help="comma-separated, of " + ", ".join(SIZES))
    parser.add_argument("--out", default=os.path.join(HERE, "memory.json"))
    a = parser.parse_args()
    sizes = [s.strip() for s in a.sizes.split(",")]
    t0 = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t0:5.0f} s, {rss() / GB:4.1f} GB] {msg}", flush=True)
    torch.manual_seed(0)
    counts = {s: parameter_counts(s) for s in sizes}
    for s in sizes:
        log(f"{s}: policy {counts[s]['policy']:,} params, critic {counts[s]['critic']:,}, "
            f"LoRA {counts[s]['lora']:,}")
    # AdamW's temporaries per trained parameter: on a small slice, trained whole
    policy, critic = build_slice("0.5B", 1)
    adam = adamw_step_transient(policy)
    del policy, critic
    log(f"foreach AdamW step: {adam['bytes_per_trained_param']:.2f} B per trained parameter above its states")
    measured, columns = {}, {}
    for s in sizes:
        measured[s] = measure_size(s, log)
        measured[s]["adamw_bytes_per_trained_param"] = adam["bytes_per_trained_param"]
        assert measured[s]["lora_params_per_layer_measured"] == counts[s]["layer_lora"], s
        columns[s] = table_columns(s, counts[s], measured[s])
    md = markdown(columns, counts)
    notes = findings(measured, counts, columns)
    print(md)
    print("\n" + "\n".join(f"- {n}" for n in notes))
    result = dict(
        setup=dict(rows=ROWS, row_tokens=ROW_TOKENS, tokens=ROWS * ROW_TOKENS, lora_rank=RANK, lengths=LENGTHS,
                   check_length=CHECK_LENGTH, prompt=PROMPT, pad=PAD, gpu_bytes=GPU_BYTES, margin=MARGIN,
                   torch=torch.__version__, autocast="cpu bf16", gradient_checkpointing=False,
                   logprob_chunk=ppo.Args().logprob_chunk, threads=torch.get_num_threads()),
        parameters=counts, adamw=adam, measured=measured, table=columns, markdown=md, findings=notes,
        seconds=time.perf_counter() - t0)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    log(f"wrote {os.path.relpath(a.out, ROOT)}")


if __name__ == "__main__":
    main()
