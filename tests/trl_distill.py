"""Record TRL 1.12's on-policy distillation loss as a fixture: tests/trl_distill.json.

TEST-ONLY, like tests/areal_decoupled.py: TRL is no requirement of this project; this script regenerates the numbers
that `--distill loss` is to be held to (issue 63). It calls trl.trainer.distillation_trainer._chunked_divergence_loss,
the generalized Jensen-Shannon divergence of TRL's DistillationTrainer, on fixed inputs and records, for each case,
the loss and d loss / d (student hidden states, student head weight).

Reproduce from the repo root, in a virtualenv of its own outside the repo (CPU is enough):
    python3.11 -m venv VENV
    VENV/bin/pip install torch==2.13.0
    VENV/bin/pip install trl==1.12.0 torch==2.13.0 requests
    VENV/bin/python tests/trl_distill.py

Inputs: float32 draws from a seeded generator. A student of hidden size 8 and a teacher of 12 (only the vocabulary,
17, is shared), 3 rows of 7 positions: right padding, a multi-turn row with a hole in its mask (positions whose
hidden states are set wild, so that a loss that read them would show), a row with every position in the loss.
Cases: beta 0 (forward KL), 0.5 (JSD), 1 (reverse KL) and 0.3; temperature 1 and 0.7; the loss a mean over the
valid positions (num_items_in_batch None) or a sum over a given count (num_items_in_batch 20); chunks of 4 positions
(the valid ones do not fill whole chunks). TRL computes the logits in float32 whatever the inputs' dtype (its
`.float()`), so the fixture holds float32 results: a float64 implementation is to match them to float32's rounding.
"""
import datetime
import json
import os

import torch
import trl
from trl.trainer.distillation_trainer import _chunked_divergence_loss


def inputs():
    g = torch.Generator().manual_seed(0)
    B, K, Hs, Ht, V = 3, 7, 8, 12, 17
    hs, ht = torch.randn(B, K, Hs, generator=g), torch.randn(B, K, Ht, generator=g)
    ws, wt = torch.randn(V, Hs, generator=g) * 0.5, torch.randn(V, Ht, generator=g) * 0.5
    mask = torch.ones(B, K)
    mask[0, 5:] = 0  # right padding
    mask[1, 2:4] = 0  # a multi-turn hole: an observation's positions
    hs[0, 5:], hs[1, 2:4], ht[0, 5:], ht[1, 2:4] = 50.0, -50.0, 50.0, -50.0  # wild where no loss may read
    return hs, ht, ws, wt, mask


def main():
    hs, ht, ws, wt, mask = inputs()
    cases = []
    for beta in (0.0, 0.3, 0.5, 1.0):
        for temperature in (1.0, 0.7):
            for items in (None, 20):
                h, w = hs.clone().requires_grad_(), ws.clone().requires_grad_()
                loss, _, n_valid = _chunked_divergence_loss(h, ht, w, wt, mask, beta, 4, num_items_in_batch=items,
                                                            temperature=temperature)
                loss.backward()
                cases.append(dict(beta=beta, temperature=temperature, num_items_in_batch=items, loss=loss.item(),
                                  n_valid=int(n_valid), grad_hidden=h.grad.tolist(), grad_head=w.grad.tolist()))
    out = dict(trl=trl.__version__, torch=torch.__version__, recorded=datetime.date.today().isoformat(),
               chunk_size=4, inputs=dict(student_hidden=hs.tolist(), teacher_hidden=ht.tolist(),
                                         student_head=ws.tolist(), teacher_head=wt.tolist(), mask=mask.tolist()),
               cases=cases)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trl_distill.json")
    json.dump(out, open(path, "w"), indent=1)
    print(f"{len(cases)} cases of TRL {trl.__version__} -> {path}")


if __name__ == "__main__":
    main()
