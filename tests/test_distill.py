"""On-policy distillation (issue 63), its first form: --teacher in the reference's place, each sampled token's reverse
KL to it (k1) as phase 4's per-token reward (Agarwal et al. 2024; Thinking Machines 2025). Checked against its
definition, recomputed here by plain forwards of the student and the teacher; the refusals in one line."""

import json
import math
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import ppo
from fp32 import EPS, logprob_tolerance
from test_in_process import run_main
from test_less_work import rollouts_logged


def perturbed_teacher(world, path, scale=0.05):
    """The toy policy with every weight moved by scale x N(0, 1) noise (seeded): another model, the same tokenizer."""
    model = AutoModelForCausalLM.from_pretrained(world[0])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(world[0]).save_pretrained(path)
    return str(path)


def sampled_logprobs(model_path, rollout, temperature=0.7):
    """log p of each response token at tau by a plain HF forward of the whole rows (left padding: positions from the
    attention mask): (B, T), 0 off the mask."""
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    qr, am, T = rollout.query_responses, rollout.attention_mask, rollout.mask.shape[1]
    with torch.no_grad():
        logits = model(input_ids=qr, attention_mask=am, position_ids=(am.cumsum(1) - 1).clamp(min=0)).logits
    logp = torch.log_softmax(logits[:, -T - 1:-1].float() / temperature, -1)  # (B, T, V): each predicts the next
    return logp.gather(-1, qr[:, -T:, None]).squeeze(-1) * rollout.mask  # (B, T)


@pytest.mark.fast
@pytest.mark.parametrize("lora_rank", [0, 8])
def test_the_reward_form_is_each_sampled_tokens_reverse_kl_to_the_teacher(world, tmp_path, monkeypatch, lora_rank):
    """At beta 0 and --distill-coef 0.5: the non-score reward is -0.5 (log p_student - log p_teacher) on every
    response token, the score is where it was, objective/distill_kl is the k1 sum a response; no reference is run
    (the passes: the student's, the teacher's, the training forward). With LoRA the teacher is a model of its own,
    not the adapters-off base (which is the student at update 1: its term would be 0)."""
    teacher = perturbed_teacher(world, tmp_path / "teacher")
    seen = rollouts_logged(monkeypatch)
    passes, real_pass = [], ppo.policy_logprobs
    monkeypatch.setattr(ppo, "policy_logprobs", lambda m, *a, **k: passes.append(m) or real_pass(m, *a, **k))
    monkeypatch.setattr(ppo, "chunked_head_works", lambda model, device: True)  # (its own 8-token probes)
    row = run_main("test_distill_reward", teacher=teacher, kl_coef=0.0, distill_coef=0.5, num_ppo_epochs=1,
                   lora_rank=lora_rank)[0]
    r = seen[0]
    assert len({id(m) for m in passes}) == 2 and len(passes) == 3  # student, teacher, the student trained
    student, theirs = sampled_logprobs(world[0], r), sampled_logprobs(teacher, r)  # update 1: the initial student
    k1 = (student - theirs) * r.mask  # (B, T)
    tol = 2 * max(logprob_tolerance(world[0]), logprob_tolerance(teacher))  # two log-probs, each its fp32 rounding
    assert k1.abs().max() > 100 * tol  # (the teacher is another model: the term is not rounding)
    torch.testing.assert_close(r.non_score_reward, -0.5 * k1, rtol=0, atol=0.5 * tol)
    last = (torch.arange(len(r.lengths)), r.lengths - 1)
    torch.testing.assert_close((r.rewards - r.non_score_reward)[last], r.scores, rtol=0,
                               atol=2 * EPS * r.rewards.abs().max().item())  # the score on the last token (r + s - r)
    n = int(r.mask.sum(1).max())
    assert row["objective/distill_kl"] == pytest.approx(k1.sum(1).mean().item(), abs=n * tol)
    assert "objective/kl" not in row  # beta 0: no reference loaded or run


def test_an_agents_observations_take_no_teacher_term(tmp_path, monkeypatch):
    """The guess world's episodes: the teacher scores the agent's tokens only; an observation's tokens (off the
    mask) take no term, as they take no KL."""
    import guess
    teacher = perturbed_teacher((guess.build_world()[0],), tmp_path / "teacher")
    seen = rollouts_logged(monkeypatch)
    rows = run_main("test_distill_guess", model="guess", teacher=teacher, kl_coef=0.0, total_episodes=32,
                    batch_size=32)
    r = seen[0]
    observations = (1 - r.mask) * r.attention_mask[:, -r.mask.shape[1]:]  # (B, T): the env's tokens
    assert rows[0]["env/turns"] > 1 and observations.sum() > 0
    assert (r.non_score_reward[observations.bool()] == 0).all() and (r.non_score_reward[r.mask.bool()] != 0).any()


@pytest.mark.fast
def test_a_teacher_changes_the_old_log_probs_path_and_bad_input_is_one_line(world, tmp_path):
    """Phase 4 reads the old log-probs with a teacher (the reward form), so auto recomputes them even where one step
    would be on-policy, and on-policy is refused; the loss form reads none. A negative coefficient, --distill loss or
    --distill-coef without a teacher, a --distill-beta out of [0, 1] or without the loss form, a teacher that will not
    load, and one whose tokenizer is not the student's are refused in one line."""
    args = ppo.Args(teacher="x", num_ppo_epochs=1, kl_coef=0.0)
    ppo.check_args(args, 1)
    assert args.old_logprobs == "recompute"
    with pytest.raises(ppo.UsageError, match="no --teacher"):
        ppo.check_args(ppo.Args(teacher="x", num_ppo_epochs=1, kl_coef=0.0, old_logprobs="on-policy"), 1)
    with pytest.raises(ppo.UsageError, match="--distill-coef must be >= 0"):
        ppo.check_args(ppo.Args(teacher="x", distill_coef=-1.0), 1)
    with pytest.raises(ppo.UsageError, match="add --teacher PATH"):
        ppo.check_args(ppo.Args(distill_coef=0.5), 1)
    with pytest.raises(ppo.UsageError, match="add --teacher PATH"):  # --distill loss with nothing to distil
        ppo.check_args(ppo.Args(distill="loss"), 1)
    for bad in (dict(distill="loss", distill_beta=1.5), dict(distill_beta=0.5)):  # out of range; the reward form's
        with pytest.raises(ppo.UsageError, match="--distill-beta .*: the divergence of --distill loss"):
            ppo.check_args(ppo.Args(teacher="x", **bad), 1)
    args = ppo.Args(teacher="x", distill="loss", num_ppo_epochs=1, num_minibatches=1, kl_coef=0.0)
    ppo.check_args(args, 1)
    assert args.old_logprobs == "on-policy"  # the loss form reads no old log-probs in phase 4
    with pytest.raises(ppo.UsageError, match=r"--teacher '.*nowhere' cannot be loaded") as e:
        run_main("test_distill_bad", teacher=str(tmp_path / "nowhere"))
    assert "\n" not in str(e.value)
    other = perturbed_teacher(world, tmp_path / "other")
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["pizzeria"])  # one word more than the toy's vocabulary: another tokenizer
    tokenizer.save_pretrained(other)
    with pytest.raises(ppo.UsageError, match="--teacher .*'s tokenizer .* is not --model toy's") as e:
        run_main("test_distill_bad", teacher=other)
    assert "\n" not in str(e.value)


def test_a_student_distilled_with_no_task_score_learns_the_teachers_world(world):
    """A teacher trained by RL on the toy world (40 updates), then the untrained student distilled from it with the
    reward model's weight 0, by each form: the student's gold rises beyond sampling noise; in the reward form its
    reverse KL to the teacher falls to under a tenth, in the loss form (beta 0.5: a JSD, at most log 2 a token) the
    divergence to under a half."""
    from test_data_rewards import gold_gain_beyond_noise
    run_main("test_distill_teacher", total_episodes=64 * 40, batch_size=64)
    for form, key, fall in (("reward", "objective/distill_kl", 10), ("loss", "ppo/loss/distill_avg", 2)):
        rows = run_main(f"test_distill_student_{form}", total_episodes=64 * 30, batch_size=64, kl_coef=0.0,
                        teacher="runs/test_distill_teacher/policy", reward_model_weight=0.0, distill=form,
                        **({"distill_beta": 0.5} if form == "loss" else {}))
        gold, divergence = [r["objective/gold"] for r in rows], [r[key] for r in rows]
        assert all(r["objective/scores"] <= 0 for r in rows)  # no task score (0, or a cut response's penalty)
        assert gold_gain_beyond_noise(gold), (form, gold)
        assert sum(divergence[-5:]) / 5 < divergence[0] / fall, (form, divergence)


@pytest.mark.mutants  # (a minute: outside the fast subset; the mutation check runs it)
def test_a_teacher_sharded_on_two_ranks_gives_the_run_of_one(world):
    """FSDP2 under torchrun, the loss form: the teacher sharded as the reference is (--shard-frozen) and run in
    phase 7 beside the sharded policy; the run within fp32's rounding of the one-rank run, its divergence included.
    (The reward form's teacher is read in phase 3 by the sharded pass the reference's tests cover.)"""
    from test_sharded import assert_same_run, run
    teacher = perturbed_teacher(world, "runs/test_distill_teacher_perturbed")
    flags = ["--teacher", teacher, "--kl-coef", "0", "--distill", "loss"]
    two, one = run(2, "test_distill_two", *flags), run(1, "test_distill_one", *flags)
    assert all(r["ppo/loss/distill_avg"] > 0 for r in one)
    assert_same_run(two, one)


def generalized_jsd(student_hidden, student_head, teacher_hidden, teacher_head, mask, beta, temperature, items=None):
    """The generalized Jensen-Shannon divergence of Agarwal et al. 2024 as TRL 1.12 defines it, written out here
    whole-vocabulary in float64: for each position in the mask, with p_s, p_t the student's and the teacher's
    softmax(head(h) / tau) and m = beta p_t + (1 - beta) p_s, beta KL(p_t || m) + (1 - beta) KL(p_s || m)
    (beta 0: KL(p_t || p_s), the forward KL; 1: KL(p_s || p_t), the reverse); summed, over the valid positions' count
    or over `items`."""
    log_s = torch.log_softmax(student_hidden @ student_head.T / temperature, -1)  # (B, K, V)
    log_t = torch.log_softmax(teacher_hidden @ teacher_head.T / temperature, -1)  # (B, K, V)
    kl = lambda log_p, log_q: (log_p.exp() * (log_p - log_q)).sum(-1)  # (B, K)
    if beta == 0.0:
        div = kl(log_t, log_s)
    elif beta == 1.0:
        div = kl(log_s, log_t)
    else:
        log_m = torch.logaddexp(log_t + math.log(beta), log_s + math.log(1 - beta))  # (B, K, V)
        div = beta * kl(log_t, log_m) + (1 - beta) * kl(log_s, log_m)  # (B, K)
    return (div * mask).sum() / (mask.sum() if items is None else items)


@pytest.mark.fast
def test_trls_distillation_loss_is_the_generalized_jsd_written_out():
    """tests/trl_distill.json (TRL 1.12's _chunked_divergence_loss, recorded by tests/trl_distill.py): the divergence
    written out above, in float64, gives TRL's loss and its gradient in the student's hidden states and head on every
    case (beta 0, 0.3, 0.5, 1; tau 1, 0.7; a mean or a sum over a given count; padding and a multi-turn hole). TRL
    computes in float32: each logit is a sum of H products (H <= 12), off by at most d = H eps times the sum of their
    sizes; a log-softmax then by 2d, and a KL of two (or of one and the mixture) by 4d (1 + its largest |log ratio|),
    as is a softmax's gradient: the bound below is twice that."""
    fixture = json.load(open(os.path.join(os.path.dirname(__file__), "trl_distill.json")))
    f64 = lambda x: torch.tensor(x, dtype=torch.float64)
    hs, ht, ws, wt = (f64(fixture["inputs"][k]) for k in ("student_hidden", "teacher_hidden", "student_head",
                                                        "teacher_head"))
    mask = f64(fixture["inputs"]["mask"])
    size = lambda h, w: (h.abs() @ w.abs().T).max().item()  # the largest sum of |products| in a logit
    for case in fixture["cases"]:
        h, w = hs.clone().requires_grad_(), ws.clone().requires_grad_()
        loss = generalized_jsd(h, w, ht, wt, mask, case["beta"], case["temperature"], case["num_items_in_batch"])
        loss.backward()
        d = 12 * EPS * max(size(hs[mask.bool()], ws), size(ht[mask.bool()], wt)) / case["temperature"]
        log_s, log_t = (torch.log_softmax(x @ y.T / case["temperature"], -1)[mask.bool()]
                        for x, y in ((hs, ws), (ht, wt)))  # (n, V) each: the valid positions'
        tol = 2 * 4 * d * (1 + (log_s - log_t).abs().max().item())
        assert loss.item() == pytest.approx(case["loss"], abs=tol * max(1.0, abs(case["loss"]))), case["beta"]
        assert case["n_valid"] == int(mask.sum())
        torch.testing.assert_close(h.grad, f64(case["grad_hidden"]), rtol=0, atol=tol)
        torch.testing.assert_close(w.grad, f64(case["grad_head"]), rtol=0, atol=tol)
        assert (h.grad[~mask.bool()] == 0).all()  # padding and the hole take no gradient


@pytest.mark.fast
@pytest.mark.parametrize("chunk", [4, 5])
def test_the_loss_form_is_trls_distillation_loss(chunk):
    """ppo.distill_divergence, chunked (4 as TRL's recording; 5, which no valid count fills), weighted as
    --loss-agg token-mean weighs (1 / the valid count; or 1 / num_items_in_batch), in its own float32: TRL's loss and
    gradients in the student's states and head on every case of the fixture, within twice the bound above (two
    float32 computations, each within it of the float64 one), and nothing reaches padding or the hole."""
    fixture = json.load(open(os.path.join(os.path.dirname(__file__), "trl_distill.json")))
    f32 = lambda x: torch.tensor(x, dtype=torch.float32)
    hs, ht, ws, wt, mask = (f32(fixture["inputs"][k]) for k in ("student_hidden", "teacher_hidden", "student_head",
                                                              "teacher_head", "mask"))
    size = lambda h, w: (h.abs() @ w.abs().T).max().item()
    for case in fixture["cases"]:
        h, w = hs.clone().requires_grad_(), ws.clone().requires_grad_()
        head, teacher_head = torch.nn.Linear(8, 17, bias=False), torch.nn.Linear(12, 17, bias=False)
        head.weight, teacher_head.weight = torch.nn.Parameter(w), torch.nn.Parameter(wt, requires_grad=False)
        weights = mask / (mask.sum() if case["num_items_in_batch"] is None else case["num_items_in_batch"])  # (B, K)
        divergence = ppo.distill_divergence((h.flatten(0, 1), head, None), (ht.flatten(0, 1), teacher_head, None),
                                            weights, case["temperature"], case["beta"], chunk)  # (B, K)
        loss = (divergence * weights).sum()
        loss.backward()
        d = 12 * EPS * max(size(hs[mask.bool()], ws), size(ht[mask.bool()], wt)) / case["temperature"]
        log_s, log_t = (torch.log_softmax(x.double() @ y.double().T / case["temperature"], -1)[mask.bool()]
                        for x, y in ((hs, ws), (ht, wt)))  # (n, V) each
        tol = 2 * 2 * 4 * d * (1 + (log_s - log_t).abs().max().item())
        assert loss.item() == pytest.approx(case["loss"], abs=tol * max(1.0, abs(case["loss"]))), case
        torch.testing.assert_close(h.grad, f32(case["grad_hidden"]), rtol=0, atol=tol)
        torch.testing.assert_close(head.weight.grad, f32(case["grad_head"]), rtol=0, atol=tol)
        assert (divergence[~mask.bool()] == 0).all() and (h.grad[~mask.bool()] == 0).all()


@pytest.mark.fast
def test_the_loss_form_trains_on_the_divergence_of_the_policys_own_samples(world, tmp_path, monkeypatch):
    """--distill loss at beta 0.5 with no other term (beta 0, no task score, GRPO's zero advantages): the logged
    ppo/loss/distill_avg is the mean over the response tokens of the generalized JSD of the untrained student and the
    teacher, recomputed from plain forwards in float64 (within twice the first-order change that both models' log-prob
    rounding makes: the sum over the vocabulary of |d divergence / d logit| times it); no pass runs in phase 3 (one
    step on-policy: the old log-probs are the new, and the teacher is read in phase 7); the gradient has the scale of
    that mean's by a plain forward (within 2x: a sum would be the tokens' count apart); and the coefficient is a
    factor of the gradient: at 1 it is exactly twice that at 0.5 (a power of two commutes with rounding)."""
    teacher = perturbed_teacher(world, tmp_path / "teacher", scale=0.5)
    seen, grads, real_step = rollouts_logged(monkeypatch), [], ppo.optimizer_step
    passes, real_pass = [], ppo.policy_logprobs
    monkeypatch.setattr(ppo, "policy_logprobs", lambda m, *a, **k: passes.append(m) or real_pass(m, *a, **k))
    monkeypatch.setattr(ppo, "chunked_head_works", lambda model, device: True)  # (its own 8-token probes)
    monkeypatch.setattr(ppo, "optimizer_step", lambda models, *a, **k: grads.append(
        [p.grad.clone() for p in models[0].parameters() if p.grad is not None]) or real_step(models, *a, **k))
    flags = dict(teacher=teacher, distill="loss", distill_beta=0.5, kl_coef=0.0, reward_model_weight=0.0,
                 adv_estimator="grpo", group_size=4, num_ppo_epochs=1, num_minibatches=1, total_episodes=64)
    row = run_main("test_distill_loss", distill_coef=0.5, **flags)[0]
    assert len(passes) == 1  # the student's training forward: one step on its own samples is on-policy
    r, T = seen[0], seen[0].mask.shape[1]
    logits = []
    for path in (world[0], teacher):
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        with torch.no_grad():
            out = model(input_ids=r.query_responses, attention_mask=r.attention_mask,
                        position_ids=(r.attention_mask.cumsum(1) - 1).clamp(min=0)).logits
        logits.append(out[:, -T - 1:-1].double() / 0.7)  # (B, T, V)
    mask = r.mask.bool()
    s, t = (x[mask].requires_grad_() for x in logits)  # (n, V) each
    divergence = ppo.generalized_jsd(s, t, 0.5)  # (n,)
    divergence.sum().backward()  # each token's sensitivity to its logits: a logit off by d moves it by |grad| d
    tol = 2 * max((s.grad.abs().sum(-1) * logprob_tolerance(world[0])
                   + t.grad.abs().sum(-1) * logprob_tolerance(teacher)).max().item(), 1e-12)
    assert divergence.mean().item() > 10 * tol  # (another model: not rounding)
    assert row["ppo/loss/distill_avg"] == pytest.approx(divergence.mean().item(), abs=tol), tol
    assert "objective/distill_kl" not in row
    student = AutoModelForCausalLM.from_pretrained(world[0])  # the gradient's scale: the mean's, not the sum's
    s = student(input_ids=r.query_responses, attention_mask=r.attention_mask,
                position_ids=(r.attention_mask.cumsum(1) - 1).clamp(min=0)).logits[:, -T - 1:-1] / 0.7  # (B, T, V)
    (0.5 * ppo.generalized_jsd(s[mask], logits[1][mask].float(), 0.5).mean()).backward()
    plain = torch.cat([p.grad.flatten() for p in student.parameters() if p.grad is not None])
    assert 0.5 < torch.cat([g.flatten() for g in grads[0]]).norm() / plain.norm() < 2  # (n tokens apart if summed)
    half = grads[0]
    grads.clear()
    run_main("test_distill_loss_1", distill_coef=1.0, **flags)
    assert len(half) > 0 and all(torch.equal(a, 2 * b) for a, b in zip(grads[0], half))


@pytest.mark.parametrize("mode", ["vllm", "async"])
def test_the_teacher_scores_the_trainers_tokens_through_the_engine_and_beside_an_async_sampler(world, tmp_path,
                                                                                             monkeypatch, mode):
    """--vllm (the engine samples) and --async-steps 1 (a second process samples, one update behind): the teacher's
    pass is the trainer's, on the tokens sampled, so each token's reward term is -(log p - log p_teacher) with the
    trainer's old log-probs, the teacher's recomputed here by a plain forward."""
    teacher = perturbed_teacher(world, tmp_path / "teacher")
    seen = rollouts_logged(monkeypatch)
    flags = {"vllm": dict(vllm=True), "async": dict(async_steps=1)}[mode]
    rows = run_main(f"test_distill_{mode}", teacher=teacher, kl_coef=0.0, total_episodes=128, batch_size=64, **flags)
    assert len(rows) == 2 and all(math.isfinite(r["objective/distill_kl"]) for r in rows)
    for r in seen:
        theirs = sampled_logprobs(teacher, r)  # (B, T)
        tol = 2 * logprob_tolerance(teacher)
        assert (r.logprobs - theirs).abs().max() > 100 * tol
        torch.testing.assert_close(r.non_score_reward, -(r.logprobs - theirs) * r.mask, rtol=0, atol=tol)


def test_a_distilled_run_resumes_exactly_and_refuses_another_teacher(world):
    """The loss form killed at its checkpoint of update 1 and resumed logs the straight run's rows; resuming with
    another --teacher or --distill-beta is refused in one line naming the flag (the teacher is among the flags
    compared)."""
    import tyro
    from test_resume import metrics, straight_and_resumed
    teacher = perturbed_teacher(world, "runs/test_distill_resume_teacher")
    flags = ["--teacher", teacher, "--distill", "loss", "--distill-beta", "0.5", "--kl-coef", "0", "--total-episodes",
             "128", "--save-every", "1"]
    runs = straight_and_resumed("test_distill_resume", flags)
    straight, resumed = ([{k: v for k, v in r.items() if not k.startswith(("time/", "mem/"))} for r in metrics(run)]
                         for run in runs)
    assert resumed == straight and len(straight) == 2 and all(r["ppo/loss/distill_avg"] > 0 for r in straight)
    other = perturbed_teacher(world, "runs/test_distill_resume_other", scale=0.1)
    for flag, value in (("--teacher", other), ("--distill-beta", "1.0")):
        changed = list(flags)
        changed[changed.index(flag) + 1] = value
        with pytest.raises(ppo.UsageError, match=f"{flag} ") as e:  # (in this process: as the command line would)
            ppo.main(tyro.cli(ppo.Args, args=["--run-name", runs[1], "--resume", "auto", *changed]))
        assert "\n" not in str(e.value)


def test_the_loss_form_with_lora_distils_a_teacher_of_its_own(world, tmp_path):
    """--lora-rank with --distill loss: at update 1 the student is its base exactly (the adapters' B is 0), so a
    teacher taken from the adapters-off base would give a divergence of exactly 0; the teacher is a model of its own
    (the toy policy moved by noise), and the first update's divergence is that model's."""
    teacher = perturbed_teacher(world, tmp_path / "teacher")
    rows = run_main("test_distill_lora", teacher=teacher, distill="loss", lora_rank=8, kl_coef=0.0,
                    reward_model_weight=0.0, total_episodes=64 * 2, batch_size=64)
    divergence = [r["ppo/loss/distill_avg"] for r in rows]
    assert all(math.isfinite(d) for d in divergence) and divergence[0] > 1e-2, divergence
