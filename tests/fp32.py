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
