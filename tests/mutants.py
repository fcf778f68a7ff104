"""Mutation check: bugs that real PPO trainers have had, each a one-line edit of ppo.py, gae.py or adapters.py,
and the fast tests that must fail on each.

    python tests/mutants.py                  # every mutant; prints a table: mutant -> the test that killed it
    python tests/mutants.py --all            # every test that kills each mutant, not only the first (slower)
    python tests/mutants.py --only kl-swapped-in-reward position-ids-arange

Each mutant is applied to a scratch copy of the repository (ppo.py, gae.py, adapters.py, runfiles.py, the worlds,
bench.py, smollm2.py, tests/ and the toy world under runs/toy), where `python -m pytest -m "fast or mutants" tests`
runs (with -x unless --all): the fast subset and the oracles too slow for it. A mutant they let pass is a hole in the
suite: the runner exits 1. The unmutated copy must pass first.
Tests about the layout (the docs' maps, every flag read) do not count as killers.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MUTATED = ("ppo.py", "gae.py", "adapters.py", "sandbox.py", "tools.py", "asyncsampler.py", "runfiles.py")
# (name, file, the text as it is, the text as the bug has it): each text occurs exactly once in its file
MUTANTS = [
    # temperature: every log-prob and the entropy come from logits / T
    ("temperature-missing-in-rollout-pass", "ppo.py",
     "policy, qr, am, P, temperature, with_entropy=True,", "policy, qr, am, P, 0.7, with_entropy=True,"),
    ("temperature-missing-in-reference-pass", "ppo.py",
     "policy_logprobs(ref_policy, qr, am, P, temperature, keep=keep,",
     "policy_logprobs(ref_policy, qr, am, P, 0.7, keep=keep,"),
    ("temperature-missing-in-training-pass", "ppo.py",
     "new_logprobs, new_entropy, _ = policy_logprobs(policy, qr, am, P, args.temperature,",
     "new_logprobs, new_entropy, _ = policy_logprobs(policy, qr, am, P, 0.7,"),
    ("entropy-on-unscaled-logits", "ppo.py",
     "    return logprobs, lse - expected  # (b, T) each",
     "    return logprobs, torch.distributions.Categorical(logits=logits * temperature).entropy()"),
    # position ids with left padding (invisible on RoPE models)
    ("position-ids-arange", "ppo.py",
     "    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)  # (b, P+T)",
     "    position_ids = torch.arange(attention_mask.shape[1]).expand_as(attention_mask)"),
    ("position-ids-not-passed", "ppo.py",
     "attention_mask=attention_mask, position_ids=position_ids,\n                 use_cache=False, logits_to_keep",
     "attention_mask=attention_mask, position_ids=None,\n                 use_cache=False, logits_to_keep"),
    ("packed-rows-attend-across", "ppo.py",  # positions counted along the packed line: one row attends to another
     "model(input_ids=ids, position_ids=positions, use_cache=False", "model(input_ids=ids, position_ids=None, use_cache=False"),
    # the KL at its call sites
    ("kl-swapped-in-reward", "ppo.py",
     "else kl_penalty(logprobs, ref_logprobs, args.kl_estimator) * mask",
     "else kl_penalty(ref_logprobs, logprobs, args.kl_estimator) * mask"),
    ("kl-in-loss-wrong-sign", "ppo.py",
     'loss = loss + rollout.kl_coef * (kl * agg).sum()', 'loss = loss - rollout.kl_coef * (kl * agg).sum()'),
    ("adaptive-kl-wrong-sign", "ppo.py",
     "return kl_coef * (1 + error * n / args.kl_horizon)",
     "return kl_coef * (1 - error * n / args.kl_horizon)"),
    # where rewards and values are read
    ("score-on-the-last-column", "ppo.py",
     "rewards[last] += scores", "rewards[:, -1] += scores"),
    ("eos-left-out-of-the-mask", "ppo.py",
     "return torch.where(is_eos.any(1), first_eos + 1, T)", "return torch.where(is_eos.any(1), first_eos, T)"),
    ("reward-model-read-one-early", "ppo.py",
     "scores[rows] = v.gather(1, lengths[rows, None]).squeeze(1)",
     "scores[rows] = v.gather(1, lengths[rows, None] - 1).squeeze(1)"),
    ("reward-model-read-at-padding", "ppo.py",
     "scores[rows] = v.gather(1, lengths[rows, None]).squeeze(1)", "scores[rows] = v[:, -1]"),
    ("bootstrap-value-one-off", "ppo.py",
     "next_values = values_all.gather(1, lengths[:, None]).squeeze(1)",
     "next_values = values_all.gather(1, lengths[:, None] - 1).squeeze(1)"),
    ("first-value-column-dropped", "ppo.py",
     "values = values_all[:, :T] * mask", "values = values_all[:, 1:] * mask"),
    ("missing-eos-penalty-not-applied", "ppo.py",
     "scores = torch.where(has_eos, scores, args.missing_eos_penalty)",
     "scores = torch.where(has_eos, scores, scores + 0 * args.missing_eos_penalty)"),
    # the losses and their normalisation
    ("value-clip-around-the-new-values", "ppo.py",
     'value_loss(new_values, rollout.values[idx, :t],', "value_loss(new_values, new_values.detach(),"),
    ("pessimistic-bound-flipped", "ppo.py",
     "losses = torch.max(pg_losses, pg_losses2)", "losses = torch.min(pg_losses, pg_losses2)"),
    ("whitening-counts-padding", "ppo.py",
     "advantages = masked_whiten(advantages, in_loss)  # (B, T)",
     "advantages = masked_whiten(advantages, torch.ones_like(mask))  # (B, T)"),
    ("loss-divided-per-micro-batch", "ppo.py",
     "agg = loss_weights(mc_mask, mask[idx].sum(1), mb_tokens, mb_seqs,",
     "agg = loss_weights(mc_mask, mask[idx].sum(1), mc_mask.sum(), mb_seqs,"),
    ("loss-times-world-dropped", "ppo.py",
     "(loss * world if scaler is None else scaler.scale(loss * world)).backward()",
     "(loss if scaler is None else scaler.scale(loss * world)).backward()"),
    # top-k / top-p: the sampler's support
    ("support-not-built-at-rollout", "ppo.py",
     "with_entropy=True, sampler_filter=sampler_filter, chunk=chunk)",
     "with_entropy=True, sampler_filter=None, chunk=chunk)"),
    ("chunked-head-ignores-temperature", "ppo.py",
     "return chunked_logprobs(model, query_responses, attention_mask, P, temperature, with_entropy, chunk, keep,",
     "return chunked_logprobs(model, query_responses, attention_mask, P, 1.0, with_entropy, chunk, keep,"),
    ("kept-support-not-renumbered-per-chunk", "ppo.py",
     "chunk_keep = (keep[0][lo:hi] - i, keep[1][lo:hi])", "chunk_keep = (keep[0][lo:hi] * 0, keep[1][lo:hi])"),
    ("kept-support-unpacked-from-the-wrong-offset", "ppo.py",
     "first = torch.repeat_interleave(start - (count.cumsum(0) - count), count)",
     "first = torch.repeat_interleave(start * 0, count)"),
    # over-length treatments (DAPO)
    ("overlong-buffer-counted-from-the-limit", "ppo.py",
     "over = (lengths - (args.max_episode_tokens - args.overlong_buffer)).clamp(min=0)",
     "over = (lengths - args.max_episode_tokens).clamp(min=0)"),
    ("overlong-filter-keeps-the-cut-rows-in-the-normaliser", "ppo.py",
     "mb_tokens = global_sum(mask[mb_idx].sum()).clamp(min=1)",
     "mb_tokens = global_sum(rollout.mask[mb_idx].sum()).clamp(min=1)"),
    ("chunked-head-off-by-one", "ppo.py",
     "captured[0])[:, :-1].flatten(0, 1), head, softcap", "captured[0])[:, 1:].flatten(0, 1), head, softcap"),
    # the chunked head's written-out backward
    ("head-backward-rebuilds-logits-outside-autocast", "ppo.py",
     "enabled=ctx.amp[2]):", "enabled=False):"),
    ("head-backward-forgets-the-softcap", "ppo.py",
     "grad.mul_(dcap if cap else 1 / temperature)", "grad.mul_(1 / temperature)"),
    ("head-backward-entropy-sign", "ppo.py",
     "grad.mul_(s.mul_(g_entropy[:, None]).add_(g)).neg_()", "grad.mul_(s.mul_(-g_entropy[:, None]).add_(g)).neg_()"),
    # the state the loop changes, and the warm-up
    ("kl-coef-not-saved", "ppo.py", "(dict(step=update, kl_coef=kl_coef, best=best,",
     "(dict(step=update, kl_coef=args.kl_coef, best=best,"),
    ("best-not-saved", "ppo.py", "(dict(step=update, kl_coef=kl_coef, best=best,",
     "(dict(step=update, kl_coef=kl_coef, best=-math.inf,"),
    ("critic-warmup-steps-no-optimizer", "ppo.py",
     "else optimizers[1:]  # warm-up: critic only", "else []  # warm-up: critic only"),
    ("critic-warmup-steps-the-policy", "ppo.py",
     "else optimizers[1:]  # warm-up: critic only", "else optimizers  # warm-up: critic only"),
    # the health check and what it guards
    ("ratio-check-never-fires", "ppo.py",
     'if health["ppo/policy/ratio_at_start"] > tol:', 'if health["ppo/policy/ratio_at_start"] > tol and False:'),
    ("health-check-on-the-largest-token", "ppo.py",  # the old statistic: a false alarm on every bf16 run
     'if health["ppo/policy/ratio_at_start"] > tol:', 'if health["ppo/policy/ratio_max_at_start"] > 1e-3:'),
    ("value-clipfrac-counts-rounding", "ppo.py",
     "(binds & (vf_losses2 > vf_losses)).float()", "(vf_losses2 > vf_losses).float()"),
    ("bf16-ignored", "ppo.py",
     'half = "bf16" if args.precision == "auto" and device.type == "cuda" else args.precision', 'half = "fp32"'),
    ("attention-dropout-left-on", "ppo.py",
     "            m.attention_dropout = 0.0", "            m.attention_dropout = m.attention_dropout"),
    # GAE
    ("gae-gamma-and-lambda-swapped", "gae.py",
     "delta = rewards[:, t] + gamma * nextvalues - values[:, t]",
     "delta = rewards[:, t] + lam * nextvalues - values[:, t]"),
    ("gae-bootstrap-not-carried-over-padding", "gae.py",
     "nextvalues = torch.where(valid.bool(), values[:, t], nextvalues)", "nextvalues = values[:, t]"),
    # issue 25: the checkpoints people use, and ten silent defects
    ("bf16-checkpoint-trained-in-bf16", "ppo.py",
     "                                dtype=torch.float32, **kw)", "                                **kw)"),
    ("drawn-token-left-out-of-its-support", "ppo.py",
     "    if tokens is not None:\n        support.scatter_", "    if False:\n        support.scatter_"),
    ("reference-on-the-full-softmax", "ppo.py",
     "policy_logprobs(ref_policy, qr, am, P, temperature, keep=keep,",
     "policy_logprobs(ref_policy, qr, am, P, temperature, keep=None,"),
    ("lam-alpha-not-clamped", "ppo.py",
     "(args.lam_alpha * mask.sum(1))).clamp(0, 1))[0]", "(args.lam_alpha * mask.sum(1))))[0]"),
    ("lam-alpha-of-the-mean-length", "ppo.py",
     "(args.lam_alpha * mask.sum(1))).clamp(0, 1))[0]", "(args.lam_alpha * mask.sum(1).mean())).clamp(0, 1))[0]"),
    ("lam-alpha-also-in-the-critic-targets", "ppo.py",
     "advantages = gae((1 - 1 / (args.lam_alpha * mask.sum(1))).clamp(0, 1))[0]",
     "advantages, returns = gae((1 - 1 / (args.lam_alpha * mask.sum(1))).clamp(0, 1))"),
    ("critic-lam-branch-disabled", "ppo.py",
     "if args.critic_lam is not None:  # decoupled GAE", "if False:  # decoupled GAE"),
    ("k1-in-the-loss-by-default", "ppo.py",
     'self.kl_estimator = "k3" if self.kl_in_loss else "k1"', 'self.kl_estimator = "k1"'),
    ("health-check-passes-nan", "ppo.py",
     'if not math.isfinite(health["ppo/policy/ratio_at_start"]):', "if False:"),
    ("ratio-on-padding-not-masked", "ppo.py",
     "new_logprobs = torch.where(mc_mask.bool(), new_logprobs, old_logprobs)", "new_logprobs = new_logprobs"),
    ("group-advantages-whitened-again", "ppo.py",
     'self.whiten_advantages = ESTIMATORS[self.adv_estimator]["whiten"]', "self.whiten_advantages = True"),
    ("explicit-resume-keeps-the-later-steps", "ppo.py",
     "if int(os.path.basename(later)[5:]) >= first_update:", "if int(os.path.basename(later)[5:]) >= 10**9:"),
    ("explicit-resume-keeps-a-later-best", "ppo.py",
     'json.load(open(best_json))["step"] >= first_update:', 'json.load(open(best_json))["step"] >= 10**9:'),
    ("rows-keyed-by-rank", "ppo.py", "generate_state(n * (rank + 1))[-n:]", "generate_state(n)"),
    ("minibatches-dealt-per-rank", "ppo.py", "deal.ravel()[rank * n: (rank + 1) * n]", "deal.ravel()[:n]"),
    ("overlong-filter-whitens-the-cut-responses", "ppo.py",
     "in_loss = mask * has_eos[:, None] if args.overlong_filter else mask", "in_loss = mask"),
    ("reward-model-ignores-the-token-budget", "ppo.py",
     "        budget=None):\n    \"\"\"The RM's score",
     "        budget=None):\n    budget = None\n    \"\"\"The RM's score"),
    ("keep-best-kept-across-a-change", "ppo.py",
     "        best = -math.inf  # the best so far", "        best = best  # the best so far"),
    ("critic-free-bootstrap-accepted", "ppo.py",
     'if not critic and (args.bootstrap_truncated', 'if False and (args.bootstrap_truncated'),
    ("dual-clip-left-out-of-the-clip-fraction", "ppo.py",
     "clipped = clipped | capped  # (b, t)", "clipped = clipped  # (b, t)"),
    ("prompt-groups-tiled", "ppo.py",
     "np.repeat(order[offset: offset + n_prompts], args.group_size)",
     "np.tile(order[offset: offset + n_prompts], args.group_size)"),
    ("checkpoint-retention-off-by-one", "ppo.py",
     "list_checkpoints(ckpt_root)[:-args.keep_checkpoints]",
     "list_checkpoints(ckpt_root)[:-args.keep_checkpoints - 1]"),
    # values where a test once checked only that the update changes
    ("entropy-bonus-sign", "ppo.py",
     "loss = loss - args.ent_coef * (new_entropy * agg).sum()",
     "loss = loss + args.ent_coef * (new_entropy * agg).sum()"),
    ("reward-whitening-shifts-the-mean", "ppo.py",
     "rewards = masked_whiten(rewards, mask, shift_mean=False)", "rewards = masked_whiten(rewards, mask)"),
    ("group-std-biased", "ppo.py",
     "r.std(1, keepdim=True) + 1e-6)", "r.std(1, keepdim=True, unbiased=False) + 1e-6)"),
    ("rloo-mean-of-all", "ppo.py",
     "(r.sum(1, keepdim=True) - r) / (group_size - 1)", "r.mean(1, keepdim=True)"),
    # multi-turn episodes (--env): what the agent did against what the world said
    ("observations-in-the-action-mask", "ppo.py",
     "action[i] += [0.0] * len(obs_ids)", "action[i] += [1.0] * len(obs_ids)"),
    ("gae-cut-at-observations", "gae.py",
     "order = torch.sort((mask == 0).to(torch.uint8), dim=1, stable=True).indices",
     "order = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)"),
    ("step-reward-on-the-turns-first-token", "ppo.py",
     "reward[i] += [0.0] * (n - 1) + [r]", "reward[i] += [r] + [0.0] * (n - 1)"),
    ("actions-decoded-and-re-tokenized", "ppo.py",
     "turn_ids = qr[k, P:P + n].tolist()",
     "turn_ids = tokenizer(tokenizer.decode(qr[k, P:P + n]), add_special_tokens=False).input_ids"),
    ("kl-on-observations", "ppo.py",
     "else kl_penalty(logprobs, ref_logprobs, args.kl_estimator) * mask",
     "else kl_penalty(logprobs, ref_logprobs, args.kl_estimator) * attention_mask[:, P:]"),
    ("append-only-checked-on-a-placeholder-alone", "ppo.py",
     "after_text.startswith(with_text) and", "True and"),
    ("observation-delta-keeps-the-sampled-stop-token", "ppo.py",
     "end = end.split(stop_text, 1)[1]", "end = end"),
    ("lora-reference-keeps-the-adapters", "ppo.py", "layer.enable_adapters(False)", "layer.enable_adapters(True)"),
    ("lora-merge-scale-wrong", "adapters.py", 'W.float() + layers[owner].scaling["default"] * delta',
     "W.float() + delta"),
    ("lora-base-trained", "ppo.py", 'p.requires_grad = ".lora_" in name or', "p.requires_grad = True or"),
    ("lora-dropout-on", "ppo.py", "lora_alpha=args.lora_alpha, lora_dropout=0.0,",
     "lora_alpha=args.lora_alpha, lora_dropout=0.1,"),
    ("lora-merged-into-the-base-in-place", "adapters.py",
     'yield f"{owner}.weight", W.float() + layers[owner].scaling["default"] * delta',
     'yield f"{owner}.weight", W.add_(layers[owner].scaling["default"] * delta)'),
    # issue 38: a merge rounded to a bf16 base's dtype loses most of a small update; GPT-2's Conv1D is (in, out)
    ("lora-merge-rounds-to-the-base-dtype", "adapters.py",
     'yield f"{owner}.weight", W.float() + layers[owner].scaling["default"] * delta',
     'yield f"{owner}.weight", (W.float() + layers[owner].scaling["default"] * delta).to(W.dtype)'),
    ("lora-merge-ignores-fan-in-fan-out", "adapters.py", "if layers[owner].fan_in_fan_out:", "if False:"),
    ("lora-merged-policy-saved-in-the-base-dtype", "ppo.py", "dtype = torch.float32  # W + s B A",
     "dtype = dtype  # W + s B A"),
    ("lora-bf16-base-casts-the-whole-model", "ppo.py", "layer.get_base_layer().to(torch.bfloat16)",
     "model.to(torch.bfloat16)"),
    # the 2025 objectives (killed by the veRL 0.9.1 fixture, tests/verl_objectives.json)
    ("gspo-sequence-ratio-not-length-normalised", "ppo.py",
     "seq_logratio = (logratio * mask).sum(1) / mask.sum(1).clamp(min=1)", "seq_logratio = (logratio * mask).sum(1)"),
    ("cispo-weight-not-detached", "ppo.py", "weight = ratio.clamp(max=cap).detach()", "weight = ratio.clamp(max=cap)"),
    ("pass-at-k-with-replacement", "ppo.py", "return 1.0 - math.comb(n - c, k) / math.comb(n, k)",
     "return 1.0 - (1 - c / n) ** k"),  # the biased estimate (Chen et al. 2021, their footnote)
    ("dynamic-sampling-keeps-a-dropped-group", "ppo.py",
     "signal = torch.nonzero((s != s[:, :1]).any(1)).squeeze(1)", "signal = torch.arange(len(s), device=device)"),
    ("dynamic-sampling-refill-from-the-main-stream", "ppo.py",
     "idx = refill_order(update, refill, questions, args, rank, world)",
     "idx = prompt_order(update + refill, len(rows), args, rank, B)"),
    # issue 38: DAPO judges a group on the task's score, refills with new questions, and --kl-target counts the rows
    ("dynamic-sampling-judges-shaped-scores", "ppo.py", "s = batch.scores.view(-1, G)",
     "s = long_responses(batch.scores, batch.has_eos, batch.lengths, None, args)[0].view(-1, G)"),
    ("dynamic-sampling-redraws-a-question", "ppo.py", "order = order[~np.isin(questions[order], questions[drawn])]",
     "order = order"),
    ("kl-target-over-the-nominal-batch", "ppo.py", "error = float(np.clip(total / n / args.kl_target - 1",
     "error = float(np.clip(total / args.batch_size / args.kl_target - 1"),
    ("gae-ablation-flag-ignored", "ppo.py", "if not args.gae_across_observations and turn_ends is not None:",
     "if False:"),
    ("textarena-echoes-the-agents-move", "adapters.py",
     "if kind != ta.ObservationType.PLAYER_ACTION)", "if True)"),
    # issue 39: turns counted from the env (an empty observation leaves no hole in the mask), over all ranks
    ("env-turns-from-the-mask", "ppo.py", "turns = rollout.turn_ends.sum(1)  # (B,)",
     "turns = (torch.diff(mask, dim=1, prepend=torch.zeros_like(mask[:, :1])) > 0).sum(1).float()"),
    ("turns-when-ended-on-this-rank-alone", "ppo.py",
     "n_ended, turns_ended = global_sum(torch.stack([ended.sum(), (turns * ended).sum()])).tolist()",
     "n_ended, turns_ended = torch.stack([ended.sum(), (turns * ended).sum()]).tolist()"),
    # --rollout-correction (issue 43): each mode's one-line bug, and the losses' use of its weights and mask
    ("token-is-uncapped", "ppo.py", "weights = raw.clamp(max=high) if capped else", "weights = raw if capped else"),
    ("seq-is-a-weight-per-token", "ppo.py", "            log_ratio = log_ratio.sum(1, keepdim=True)  # (B, 1)",
     "            log_ratio = log_ratio  # (B, 1)"),
    ("icepop-clips-instead-of-zeroing", "ppo.py", "raw * ((raw >= low) & (raw <= high))", "raw.clamp(low, high)"),
    ("token-mask-per-response", "ppo.py", '    if mode != "token-mask":  # seq-mask', '    if True:  # seq-mask'),
    ("seq-mask-takes-the-mean", "ppo.py", 'if mode == "geo-mask" else 1)', 'if mode != "token-mask" else 1)'),
    ("geo-mask-takes-the-sum", "ppo.py", "(mask.sum(1, keepdim=True).clamp(min=1) if mode == ", "(1 if mode == "),
    ("correction-reads-observation-tokens", "ppo.py", "log_ratio = (logprobs - sampler_logprobs).detach() * mask",
     "log_ratio = (logprobs - sampler_logprobs).detach()"),
    ("decoupled-clamps-above-the-cap", "ppo.py", 'behav_imp_weight_cap", 0.0, 5.0)',  # TIS, not AReaL's zeroing
     'behav_imp_weight_cap", None, 5.0)'),
    # --async-steps 1: the sampler draws with the weights of two updates before; the batch in flight is checkpointed
    ("sampler-never-gets-new-weights", "asyncsampler.py", "                mine.copy_(new)", "                pass"),
    ("batch-in-flight-not-restored", "ppo.py", 'best, state.get("drawn")', "best, None"),
    ("masked-tokens-stay-in-the-losses", "ppo.py", "rollout.kept if args.rollout_correction else rollout.mask",
     "rollout.mask"),
    ("is-weights-not-applied", "ppo.py",
     "pg_weights = agg * rollout.is_weights[idx, :t] if args.rollout_correction else agg", "pg_weights = agg"),
    ("sampler-logprobs-without-temperature", "ppo.py", "self.taken.append(torch.log_softmax(logits, -1)",
     "self.taken.append(torch.log_softmax(logits * tau, -1)"),
    # fp16 and the fp32 head (issue 44)
    ("fp16-loss-not-scaled", "ppo.py", "(loss * world if scaler is None else scaler.scale(loss * world)).backward()",
     "(loss * world).backward()"),
    ("fp16-scale-never-lowered", "ppo.py", "        scaler.update()\n", "        pass\n"),
    ("fp32-head-left-under-autocast", "ppo.py", "        with torch.autocast(hidden.device.type, enabled=False):\n"
     "            return forward(hidden.float())", "        with contextlib.nullcontext():\n"
     "            return forward(hidden.float())"),
    ("fp32-head-chunks-under-autocast", "ppo.py", 'fp32 = getattr(head, "fp32", False)  # --fp32-head: the chunks',
     "fp32 = False  # --fp32-head: the chunks"),
    # issue 51: loose ends
    ("seq-mean-over-every-row", "ppo.py",  # veRL's trainer: a mask's rejected responses stay in the divisor
     "mb_seqs = global_sum((mask[mb_idx].amax(1) > 0).sum().float()).clamp(min=1)",
     "mb_seqs = global_sum(torch.tensor(float(len(mb_idx)))).clamp(min=1)"),
    ("correction-weights-carry-gradient", "ppo.py", "(logprobs - sampler_logprobs).detach() * mask",
     "(logprobs - sampler_logprobs) * mask"),
    ("reward-bound-to-the-module-name", "ppo.py", 'self.reward_fn = "reasoning-gym"',
     'self.reward_fn = "ppo:reasoning_gym_reward"'),
    ("kl-estimator-falls-through", "ppo.py", '    if estimator == "k3":\n', "    if True:\n"),
    ("loss-agg-falls-through", "ppo.py", '    if mode == "seq-sum-norm":  # Dr. GRPO', "    if True:  # Dr. GRPO"),
    ("policy-loss-falls-through", "ppo.py", '    if args.policy_loss == "ppo":\n', "    if True:\n"),
    # issue 62: a checkpoint of a never-stepped AdamW must not count torch's initialising step as its first
    ("fresh-adamw-saved-at-step-1", "ppo.py", "fresh = not opt.state  # never stepped", "fresh = False  # never stepped"),
    # issue 66: PPO's epochs reshuffle the batch into new minibatches; issue 62: each random stream its own seeds
    ("minibatch-deal-ignores-the-epoch", "ppo.py", 'STREAMS["minibatches"], update, epoch])',
     'STREAMS["minibatches"], update, 0])'),
    ("minibatch-deal-ignores-the-update", "ppo.py", 'STREAMS["minibatches"], update, epoch])',
     'STREAMS["minibatches"], 1, epoch])'),
    ("minibatch-stream-untagged", "ppo.py", '[args.seed, STREAMS["minibatches"], update, epoch]',
     "[args.seed, update, epoch]"),
    ("row-keys-untagged", "ppo.py", 'key = [args.seed, STREAMS["rows"], update,', "key = [args.seed, update,"),
    # issue 62: PPO-ptx the same run on any number of ranks
    ("ptx-keyed-by-the-local-offset", "ppo.py", "update, epoch, mb_start // mb_rows])", "update, epoch, mb_start])"),
    ("ptx-a-mean-of-each-ranks-means", "ppo.py", "labels=labels, num_items_in_batch=tokens).loss * world",
     "labels=labels).loss"),
    # issue 63: on-policy distillation, the reward form
    ("teacher-reward-sign-flipped", "ppo.py", "args.distill_coef * (logprobs - teacher_logprobs)",
     "args.distill_coef * (teacher_logprobs - logprobs)"),
    ("teacher-reward-off-the-mask", "ppo.py", "(logprobs - teacher_logprobs) * mask  # k1",
     "(logprobs - teacher_logprobs)  # k1"),
    ("teacher-at-another-temperature", "ppo.py", "policy_logprobs(teacher, qr, am, P, temperature,",
     "policy_logprobs(teacher, qr, am, P, 1.0,"),
    ("teacher-tokenizer-not-checked", "ppo.py", "if theirs and (theirs.get_vocab(), theirs.chat_template)",
     "if False and (theirs.get_vocab(), theirs.chat_template)"),
    ("on-policy-old-logprobs-with-a-teacher", "ppo.py", "or self.teacher and self.distill == \"reward\")",
     "or False)"),
    # issue 63: the loss form
    ("distill-forward-and-reverse-kl-swapped", "ppo.py", "kl(log_t, log_s) if beta == 0.0 else kl(log_s, log_t)",
     "kl(log_s, log_t) if beta == 0.0 else kl(log_t, log_s)"),
    ("distill-mixture-weights-swapped", "ppo.py", "log_t + math.log(beta), log_s + math.log1p(-beta)",
     "log_t + math.log1p(-beta), log_s + math.log(beta)"),
    ("distill-mixture-terms-swapped", "ppo.py", "beta * kl(log_t, log_m) + (1 - beta) * kl(log_s, log_m)",
     "beta * kl(log_s, log_m) + (1 - beta) * kl(log_t, log_m)"),
    ("distill-coef-dropped", "ppo.py", "loss = loss + args.distill_coef * (divergence * agg).sum()",
     "loss = loss + (divergence * agg).sum()"),
    ("distill-summed-not-weighted", "ppo.py", "args.distill_coef * (divergence * agg).sum()",
     "args.distill_coef * (divergence * mc_mask).sum()"),
    ("distill-teacher-is-the-student", "ppo.py", "teacher_states = head_states(teacher, qr, am, P)",
     "teacher_states = head_states(policy, qr, am, P)"),
    ("distill-at-temperature-1", "ppo.py", "distill_divergence(states, teacher_states, agg, args.temperature,",
     "distill_divergence(states, teacher_states, agg, 1.0,"),
    ("distill-on-padding-too", "ppo.py", "rows = weights.flatten().nonzero().squeeze(1)",
     "rows = torch.arange(weights.numel(), device=weights.device)"),
    ("distill-teacher-in-phase-3-too", "ppo.py", "else (None, models.teacher)  # phase 3 or 7",
     "else (models.teacher, models.teacher)  # phase 3 or 7"),
    ("distill-loss-form-auto-recomputes", "ppo.py", "or self.teacher and self.distill == \"reward\")",
     "or self.teacher)"),
    # issue 62: the smaller findings
    ("evaluation-drops-the-last-prompts", "ppo.py", "for j in range(rank, -(-n // world) * world, world)]",
     "for j in range(rank, n - n % world, world)]"),
    ("beta-0-kl-through-a-zero-reference", "ppo.py", "kl = 0 * mask if ref_policy is None else",
     "kl = 0 * mask if False else"),
    ("beta-0-kl-in-loss-through-a-zero-reference", "ppo.py", "if args.kl_in_loss and not no_reference(args):",
     "if args.kl_in_loss:"),
    ("sampler-keeps-half-the-threads", "asyncsampler.py", "        torch.set_num_threads(self.cores)\n", ""),
    ("checkpoint-of-non-finite-state", "ppo.py", "if global_sum(sum((~x.isfinite()).sum() for x in local",
     "if 0 * global_sum(sum((~x.isfinite()).sum() for x in local"),
    ("dual-clip-tie-takes-the-whole-gradient", "ppo.py",
     "torch.where(advantages < 0, torch.min(losses, -dual_clip * advantages), losses)",
     "torch.where(capped, -dual_clip * advantages, losses)"),
    ("ref-model-at-beta-0-accepted", "ppo.py", "    if args.ref_model and no_reference(args):", "    if False:"),
    # issue 62: one meaning per bound value
    ("mask-low-0-takes-a-log", "ppo.py", "floor = math.log(low) if low > 0 else -math.inf", "floor = math.log(low)"),
    ("high-0-becomes-the-default", "ppo.py", "(high if self.rollout_correction_high is None",
     "(high if not self.rollout_correction_high"),
    ("a-cap-given-a-lower-bound", "ppo.py",
     'if args.rollout_correction in ("token-is", "seq-is") and args.rollout_correction_low is not None:', "if False:"),
    ("mask-mode-falls-through", "ppo.py", 'if mode not in ("token-mask", "seq-mask", "geo-mask"):',
     "if False:"),
    # issue 52: less model work per update, each saving's one-line bug
    ("on-policy-old-logprobs-not-detached", "ppo.py", "rollout.logprobs[idx, :t] = new_logprobs.detach() * rollout",
     "rollout.logprobs[idx, :t] = new_logprobs * rollout"),
    ("entropy-not-filled-without-the-pass", "ppo.py", "rollout.entropy[idx, :t] = new_entropy.detach() * rollout",
     "rollout.entropy[idx, :t] = 0 * rollout"),
    # issue 62: without phase 3's pass, the metrics' tokens are every response token a pass saw
    ("entropy-filled-on-the-loss-mask", "ppo.py", "new_entropy.detach() * rollout.mask[idx, :t]",
     "new_entropy.detach() * mc_mask"),
    ("old-logprobs-filled-on-the-loss-mask", "ppo.py", "new_logprobs.detach() * rollout.mask[idx, :t]",
     "new_logprobs.detach() * mc_mask"),
    ("entropy-averaged-over-tokens-no-pass-saw", "ppo.py", "mask * rollout.entropy.isfinite()).item(),",
     "mask).item(),"),
    ("health-check-blind-on-policy", "ppo.py", 'if fill and args.old_logprobs == "on-policy":  # (as', "if False:  # (as"),
    ("sampler-logprobs-not-the-old-ones", "ppo.py", "logprobs = engine_logprobs * mask  # (B, T)",
     "logprobs = logprobs  # (B, T)"),
    ("sampler-logprobs-of-the-last-token", "ppo.py", "-1).gather(1, token[:, None]))  # (B, 1)",
     "-1).gather(1, input_ids[:, -1:]))  # (B, 1)"),
    # issue 62: the sampler's log-probs on the support it drew from; its sum and uniforms fine enough for 152k tokens
    ("sampler-logprobs-on-the-whole-vocabulary", "ppo.py", "self.taken.append(torch.log_softmax(logits, -1)",
     "self.taken.append(torch.log_softmax(scores.float() / tau, -1)"),
    ("sampler-cdf-in-float32", "ppo.py", "cdf = torch.softmax(logits.double(), -1).cumsum(1)",
     "cdf = torch.softmax(logits, -1).cumsum(1).double()"),
    ("sampler-uniforms-in-float32", "ppo.py", "dtype=torch.float64) for k in keys])",
     "dtype=torch.float32) for k in keys]).double()"),
    ("reference-loaded-at-beta-0", "ppo.py", "return args.kl_coef == 0 and not args.unread_reference", "return False"),
    ("adamw-never-fused", "ppo.py", "fused=kernel or None)", "fused=None)"),
    # issue 64: the sandbox for tool calls, and the calls (tests/test_tools.py)
    ("tool-call-not-closed-in", "sandbox.py", '    HELD.extend(close_in(os.getcwd(), request["limits"]))\n', ""),
    ("tool-processes-uncapped-as-root", "sandbox.py", "    group = pids_cgroup(limits.processes)",
     "    group = None"),  # (root is exempt from RLIMIT_NPROC: the cgroup is its only cap)
    ("tool-arguments-unchecked", "tools.py",
     '    wrong = argument_error(fn.schema["function"]["parameters"], call.arguments)', "    wrong = None"),
    ("tool-calls-uncapped", "tools.py", "    if len(calls) > max_calls:", "    if False:"),
]
NOT_KILLERS = ["--ignore=tests/test_docs.py", "--deselect=tests/test_e2e.py::test_every_args_field_is_read"]


def scratch_copy():
    root = tempfile.mkdtemp(prefix="mutants_")
    for name in ("ppo.py", "gae.py", "adapters.py", "runfiles.py", "asyncsampler.py", "toy.py", "chain.py", "guess.py",
                 "bench.py", "smollm2.py", "sandbox.py", "tools.py", "README.md"):
        shutil.copy(os.path.join(ROOT, name), root)
    shutil.copytree(os.path.join(ROOT, "docs"), os.path.join(root, "docs"))
    shutil.copytree(os.path.join(ROOT, "tests"), os.path.join(root, "tests"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    if not os.path.exists(os.path.join(ROOT, "runs", "toy", "world.json")):
        sys.path.insert(0, ROOT)
        import toy
        toy.build_world(os.path.join(ROOT, "runs", "toy"))
    shutil.copytree(os.path.join(ROOT, "runs", "toy"), os.path.join(root, "runs", "toy"))
    return root


def run_fast(root, stop_at_first):
    """The fast tests in `root`: (seconds, the ids of the tests that failed or errored)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "fast or mutants", "-p", "no:cacheprovider", "--timeout=300",
           "-rfE", *NOT_KILLERS, "tests"] + (["-x"] if stop_at_first else [])
    t = time.time()
    out = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out.stdout, re.M)
    if out.returncode not in (0, 1) and not failed:  # a crash of pytest itself
        failed = [f"pytest exit {out.returncode}: {out.stdout[-300:]}"]
    return time.time() - t, [f.split("tests/")[-1] for f in failed]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="list every killing test, not only the first")
    parser.add_argument("--only", nargs="*", help="names of the mutants to run")
    opts = parser.parse_args()
    chosen = [m for m in MUTANTS if not opts.only or m[0] in opts.only]
    root = scratch_copy()
    try:
        seconds, failed = run_fast(root, stop_at_first=False)
        print(f"unmutated: the fast subset takes {seconds:.0f} s, " + (f"FAILS {failed}" if failed else "passes"))
        if failed:
            sys.exit(1)
        originals = {f: open(os.path.join(root, f)).read() for f in MUTATED}
        survivors = []
        print("\n| mutant | killed by | s |\n|---|---|---:|")
        for name, path, old, new in chosen:
            src = originals[path]
            assert src.count(old) == 1, f"{name}: the text to mutate occurs {src.count(old)} times in {path}"
            open(os.path.join(root, path), "w").write(src.replace(old, new))
            seconds, failed = run_fast(root, stop_at_first=not opts.all)
            open(os.path.join(root, path), "w").write(src)
            print(f"| {name} | {', '.join(failed) or '**SURVIVED**'} | {seconds:.0f} |", flush=True)
            if not failed:
                survivors.append(name)
        print(f"\n{len(chosen) - len(survivors)} of {len(chosen)} mutants killed" +
              (f"; survivors: {', '.join(survivors)}" if survivors else ""))
        sys.exit(1 if survivors else 0)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
