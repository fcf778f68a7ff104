"""What fp32 can promise when two computations of the same values add their terms in other orders: another
micro-batch split, another matmul shape, two ranks instead of one, or another CPU's kernels (AVX-512 and
AVX2 cut a sum into other partial sums, so a tolerance fitted to one machine fails on the other).

A sum of n fp32 terms is off by at most about n * eps times the sum of the terms' sizes (Higham, Accuracy
and Stability of Numerical Algorithms, 2002, ch. 3), and by about sqrt(n) * eps for errors of random sign,
which is what other orders of the same terms give. The terms' size is not known from the outside: the
largest |expected| entry of the tensor stands in for it. A factor of 8 covers a few such sums in a row
(a layer's backward feeding the next) and terms somewhat larger than the result they cancel to."""
import math

import torch

EPS = torch.finfo(torch.float32).eps  # 2^-23


def fp32_tolerance(expected, n):
    """The absolute error to allow in any entry of `expected` (a tensor) whose longest sum has n terms."""
    return 8 * math.sqrt(n) * EPS * float(expected.detach().abs().max())


def assert_close_fp32(actual, expected, n, msg=None):
    """`actual` equals `expected` within fp32's rounding of sums of n terms, in every entry."""
    torch.testing.assert_close(actual, expected, atol=fp32_tolerance(expected, n), rtol=0, msg=msg)


def logit_bound(model):
    """The largest |logit| a model whose head reads a final RMSNorm's output (Llama, Qwen2, SmolLM2, the worlds here)
    can give any input: the normed state is x / rms(x) * g, of L2 norm at most sqrt(H) * max|g|, so by Cauchy-Schwarz
    |w_v . h| <= |w_v| * max|g| * sqrt(H) for every row w_v of the head."""
    head = model.get_output_embeddings().weight.detach().float()  # (V, H)
    gain = model.model.norm.weight.detach().float()  # (H,)
    return float(head.norm(dim=1).max() * gain.abs().max() * head.shape[1] ** 0.5)


def logprob_tolerance(model, temperature=0.7):
    """How far two fp32 computations of one token's log-prob, z / T - logsumexp(z / T), may round apart (another batch
    shape, autograd's kernels against no-grad's, another CPU's): the logits' size times fp32's rounding of the
    network's longest sum (its MLP's width). `model`: a model, or the path of a saved one."""
    if isinstance(model, str):
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(model)
    n = max(model.config.hidden_size, getattr(model.config, "intermediate_size", 0))
    return 8 * math.sqrt(n) * EPS * logit_bound(model) / temperature


def ratio_tolerance(path, temperature=0.7):
    """What fp32 allows the health check's ratio_at_start, the mean |p_train / p_rollout - 1| over a batch before any
    step, for the model saved at `path`: the two passes' log-prob tolerance (exp(x) - 1 of it). The passes see
    other batch shapes, or autograd's kernels against no-grad's, so they may round apart on one CPU and agree bit for
    bit on another: a bound fitted below this holds on one machine only. (The toy world's: 2.4e-4; the faults the
    check exists for, a temperature, a position or a dropout left out of one pass, give 1e-2 and more.)"""
    return math.expm1(logprob_tolerance(path, temperature))
