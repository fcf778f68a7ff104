"""The docs say where things are in ppo.py by name, never by line, and stay true: the README's map of ppo.py,
the ablation table's "read in" column, every link between the docs; the README's first fork recipe, applied
to a copy of ppo.py, learns; a finished run names its files and its headline figure.

    python tests/test_docs.py     # rewrites the ablation table's last column as ppo.py stands
"""
import ast
import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

DOCS = ["README.md", "experiments/README.md", *sorted(glob.glob("docs/*.md"))]
MAP_HEADING, ABLATIONS = "## Reading ppo.py", "docs/ablations.md"

# The size limits (ppo.py's lines, main's, the loop's place, --help's, the README's) are this project's discipline,
# every feature paying for its lines, not correctness: a fork whose idea adds lines turns them off here, in one line.
SIZE_LIMITS = True


def within(value, limit, what):
    assert not SIZE_LIMITS or value <= limit, (
        f"{what} is {value}, over this project's limit of {limit}: a size limit, the project's discipline rather than "
        "a bug; a fork that grows turns the size limits off with SIZE_LIMITS = False in tests/test_docs.py")


def sections(path="ppo.py"):
    """(title, first line, last line, level) of each banner's section: level 1 for the `# ===` banners,
    running to the next one; level 2 for the `# --- title ---` banners inside them."""
    lines = open(path).read().splitlines()
    starts = [("docstring and imports", 1, 1)]
    for i, line in enumerate(lines):
        if line.startswith("# ===") and i + 2 < len(lines) and lines[i + 2].startswith("# ==="):
            starts.append((lines[i + 1][2:], i + 1, 1))
        elif m := re.fullmatch(r"# --- (.+?) -+", line):
            starts.append((m.group(1), i + 1, 2))
    out = []
    for k, (title, start, level) in enumerate(starts):
        nxt = [s for _, s, lv in starts[k + 1:] if lv <= level or level == 2]
        out.append((title, start, (nxt[0] if nxt else len(lines) + 1) - 1, level))
    return out


def top_level(path="ppo.py"):
    """{name: node} of ppo.py's top-level functions, classes and tables (`ESTIMATORS = {...}`)."""
    body = ast.parse(open(path).read()).body
    return {**{n.targets[0].id: n for n in body if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)},
            **{n.name: n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}}


def reads(flag, path="ppo.py"):
    """The top-level functions of ppo.py that read `args.<flag>`, in file order, as the docs write them
    (`no_x`: tyro's negation of a boolean field `x`)."""
    nodes = top_level(path)
    fields = {n.target.id for n in nodes["Args"].body if isinstance(n, ast.AnnAssign)}
    flag = flag[3:] if flag.startswith("no_") and flag not in fields else flag
    names = [name for name, node in nodes.items() if name != "Args" and any(
        isinstance(a, ast.Attribute) and a.attr == flag and isinstance(a.value, ast.Name) and a.value.id == "args"
        for a in ast.walk(node))]
    return ", ".join(f"`{n}`" for n in names)


def table(path, heading=None):
    """The rows of the first table in `path` (under `heading`), header dropped, as lists of cells."""
    text = open(path).read()
    if heading:
        assert heading in text, heading
        text = text.split(heading, 1)[1].split("\n## ", 1)[0]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))] for line in text.splitlines()
            if line.startswith("|") and not line.startswith("|---")][1:]


@pytest.mark.fast
def test_the_readmes_map_is_the_banners_of_ppo_py_and_names_what_lies_under_each():
    rows = table("README.md", MAP_HEADING)
    assert [r[0].replace("&nbsp;", "") for r in rows] == [title for title, *_ in sections()], \
        "the README's map must list ppo.py's banners in order"
    nodes = top_level()
    for (title, first, last, level), row in zip(sections(), rows):
        for name in re.findall(r"`(\w+)`", row[1]):
            assert name in nodes, f"the map names {name}, which ppo.py does not define"
            assert first <= nodes[name].lineno <= last, f"the map puts {name} under '{title}'; it is not there"
    # the order the issue asks for: flags, the algorithm, main and its loop, then the plumbing
    majors = [t.split(":")[0].split(",")[0] for t, _, _, level in sections() if level == 1]
    assert majors == ["docstring and imports", "Flags", "The algorithm", "main", "Plumbing"]


@pytest.mark.fast
def test_the_ablation_table_names_the_functions_that_read_each_flag():
    rows = table(ABLATIONS)
    assert len(rows) >= 15
    for row in rows:
        flag = re.match(r"`--([\w-]+)", row[0]).group(1).replace("-", "_")
        assert row[-1] == reads(flag), f"--{flag}: the table says {row[-1]}, ppo.py reads it in {reads(flag)}"


@pytest.mark.fast
def test_no_doc_table_points_at_line_numbers():
    """A fork that moves lines but not what a function reads leaves every doc as it is."""
    for path in DOCS:
        for row in table(path) if "|" in open(path).read() else []:
            for cell in row:
                assert not re.fullmatch(r"\d{3,}-\d{3,}|(\d{3,}(-\d{3,})?, ){2,}\d{3,}(-\d{3,})?", cell), (path, row)


@pytest.mark.fast
def test_every_link_between_the_docs_leads_somewhere():
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", open(path).read()):
            if not target.startswith(("http://", "https://")):
                assert os.path.exists(os.path.join(os.path.dirname(path), target)), f"{path} links to {target}"
    readme = open("README.md").read()
    assert all(path in readme for path in DOCS[1:]), "the README links to every doc"
    within(len(readme.splitlines()), 300, "README.md's length in lines")


@pytest.mark.fast
def test_the_training_loop_comes_first_and_main_stays_short():
    lines = open("ppo.py").read().splitlines()
    main = next(i for i, line in enumerate(lines) if line.startswith("def main("))
    end = next(i for i in range(main + 1, len(lines)) if lines[i] and not lines[i].startswith((" ", "#")))
    body = lines[main:end]
    loop = next(i for i, line in enumerate(body) if line.startswith("    for update in "))
    loop_end = next(i for i in range(loop + 1, len(body)) if body[i].startswith("    ") and not body[i].startswith("     "))
    assert not any(re.match(r"\s+def ", x) for x in body), "no function defined inside main"
    within(main + loop_end, 1200, "the line where the training loop ends")
    within(len(body), 220, "main's length in lines")
    within(loop_end - loop, 150, "the training loop's length in lines")
    within(max(map(len, lines)), 120, "ppo.py's longest line, in characters")
    within(len(lines), 3000, "ppo.py's length in lines")


@pytest.mark.fast
def test_a_size_limit_says_it_is_one_and_how_a_fork_turns_it_off(monkeypatch):
    with pytest.raises(AssertionError, match="SIZE_LIMITS = False in tests/test_docs.py"):
        within(3001, 3000, "ppo.py's length in lines")
    monkeypatch.setattr(sys.modules[__name__], "SIZE_LIMITS", False)
    within(3001, 3000, "ppo.py's length in lines")  # a fork's 3,001 lines: no failure
    assert "`SIZE_LIMITS = False`" in open("README.md").read().split("## How to fork it")[1].split("\n## ")[0]


# what the algorithm's functions may still call below `main`: the engine, the reward sources, the env's checked
# calls and the chat template's rendering, the packing of the sampler's support, the chunked head's kernels, the
# parts of a batch, the micro-batches and the chunked head (the default log-prob path), an env's episodes (their
# token bookkeeping), whether a reference is loaded at all, the one-line error, the hook that takes the head's
# states, the keyed sampler and where a response stops
PLUMBING = {"fail", "rank_and_world", "vllm_generate", "reward_fn_scores", "reward_model_scores", "render_for_rm",
            "env_call", "env_step", "first_observation", "observation_ids", "question", "pick", "join",
            "sampling_support", "dense_support", "pack_support", "kept_pairs", "head_chunk", "HeadLogprobs",
            "micro_batches", "chunked_logprobs", "global_max", "play", "no_reference", "sampler_autocast",
            "refill_order", "head_states", "head_logits", "KeyedSampler", "response_lengths", "packed_forward",
            "packed_tokens"}


@pytest.mark.fast
def test_what_the_loop_calls_in_phases_1_to_8_is_defined_above_main():
    """A reader follows the algorithm from the flags down to the loop without scrolling past it."""
    tree = ast.parse(open("ppo.py").read())
    defined = {n.name: n.lineno for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    main = defined["main"]
    loop = next(n for n in ast.walk(tree) if isinstance(n, ast.For) and ast.unparse(n.target) == "update")
    phase9 = next(i for i, line in enumerate(open("ppo.py").read().splitlines(), 1)
                  if i > loop.lineno and line.strip().startswith("# 9."))

    def calls(node, first=0, last=10 ** 9):
        return {c.func.id for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
                and c.func.id in defined and first <= c.lineno < last}
    below = sorted(n for n in calls(loop, loop.lineno, phase9) if defined[n] > main and n != "fail")
    assert not below, f"the loop's phases 1-8 call these, defined below main: {below}"
    algorithm = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.lineno < main]
    below = sorted({n for f in algorithm for n in calls(f) if defined[n] > main} - PLUMBING)
    assert not below, f"the algorithm's functions call these, defined below main: {below}"


def apply_recipe(text, source):
    """The README's diff applied by content, not by line: each hunk's old lines (context and '-') must occur
    once in `source`, and become its new lines (context and '+')."""
    diff = text.split("```diff\n", 1)[1].split("```", 1)[0]
    for hunk in diff.split("\n@@")[1:]:
        lines = [line for line in hunk.splitlines()[1:] if line[:1] in (" ", "-", "+")]
        old = "\n".join(line[1:] for line in lines if line[0] != "+") + "\n"
        new = "\n".join(line[1:] for line in lines if line[0] != "-") + "\n"
        assert source.count(old) == 1, f"the recipe's hunk does not fit ppo.py as it stands:\n{old}"
        source = source.replace(old, new)
    return source


@pytest.mark.timeout(300)
def test_the_readmes_first_fork_recipe_learns_the_toy_world(tmp_path):
    """REINFORCE++-baseline as the README's diff writes it: the fork runs without a critic and its gold rises."""
    from test_data_rewards import gold_gain_beyond_noise
    fork = apply_recipe(open("README.md").read(), open("ppo.py").read())
    for name in ("gae.py", "adapters.py", "runfiles.py", "asyncsampler.py", "toy.py"):
        shutil.copy(name, tmp_path)
    (tmp_path / "ppo.py").write_text(fork)
    shutil.rmtree("runs/test_fork", ignore_errors=True)
    out = subprocess.run([sys.executable, str(tmp_path / "ppo.py"), "--adv-estimator", "reinforce++", "--group-size",
                          "4", "--total-episodes", str(64 * 40), "--run-name", "test_fork", "--save-every", "0"],
                         capture_output=True, text=True, timeout=280, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in open("runs/test_fork/metrics.jsonl")]
    assert json.load(open("runs/test_fork/config.json"))["adv_estimator"] == "reinforce++"
    assert not os.path.exists("runs/test_fork/critic") and "gold" in out.stdout
    gold = [r["objective/gold"] for r in rows]
    assert gold_gain_beyond_noise(gold), gold


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
@pytest.mark.fast
def test_a_finished_run_names_its_files_and_its_headline_figure(estimator, capsys):
    import ppo
    shutil.rmtree("runs/test_summary", ignore_errors=True)
    ppo.main(ppo.Args(run_name="test_summary", total_episodes=32, batch_size=16, num_ppo_epochs=1, save_every=0,
                      adv_estimator=estimator, group_size=4 if estimator == "grpo" else 1))
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in open("runs/test_summary/metrics.jsonl")]
    gold = [r["objective/gold"] for r in rows]
    assert f"gold {gold[0]:.2f} at update 1, {sum(gold) / 2:.2f} over the last 2 (of 2)" in out
    for path in ("metrics.jsonl", "samples.jsonl", "policy"):
        assert os.path.join("runs/test_summary", path) in out
    assert (os.path.join("runs/test_summary", "critic") in out) == (estimator == "gae")  # only when there is one


@pytest.mark.fast
def test_building_a_world_prints_its_steps():
    import random
    import toy
    lines = []
    tok = toy.make_tokenizer()
    toy.train_sft(tok, toy.make_config(tok), random.Random(0), steps=100, batch=4, log=lines.append)
    toy.train_reward(tok, toy.make_config(tok), random.Random(0), steps=100, batch=4, log=lines.append)
    assert [line.split(",")[1].split(" loss")[0].strip() for line in lines] == [
        "supervised step 100/100", "step 100/100 on 4 preference pairs"]


def rewrite_ablations():
    """The ablation table's last column, as ppo.py stands."""
    def fix(line):
        if not line.startswith("| `--"):
            return line
        cells = re.split(r"(?<!\\)\| ", line)
        flag = re.match(r"\| `--([\w-]+)", line).group(1).replace("-", "_")
        return "| ".join(cells[:-1] + [reads(flag) + " |"])
    text = open(ABLATIONS).read()
    open(ABLATIONS, "w").write("\n".join(map(fix, text.split("\n"))))


if __name__ == "__main__":  # python tests/test_docs.py: bring the ablation table's last column up to date
    rewrite_ablations()


@pytest.mark.fast
def test_help_fits_200_lines_and_shows_a_newcomers_flags_first():
    """`python ppo.py --help` at 120 columns: at most 200 lines, --model, --dataset, --reward-fn and --total-episodes
    in the first 60, each description at most three lines and written on one (no hard line break in a flag's help)."""
    out = subprocess.run([sys.executable, "ppo.py", "--help"], capture_output=True, text=True,
                         env=dict(os.environ, COLUMNS="120"), check=True).stdout.splitlines()
    within(len(out), 200, "--help's length in lines at 120 columns")
    for flag in ("--model ", "--dataset ", "--reward-fn ", "--total-episodes "):
        assert any(line[2:].startswith(flag) for line in out[:60]), flag
    entries = []  # the help's lines of each flag: its invocation, then its description
    for line in out[3:-1]:
        inner = line[2:-1].rstrip()
        if inner.startswith("-"):
            entries.append([inner])
        elif entries:
            entries[-1].append(inner)
    for entry in entries:  # a description beside its flag starts on the flag's line
        described = len(entry) - (0 if re.search(r"\S  +\S", entry[0]) else 1)
        assert described <= 3, entry
    fields = [n for n in top_level()["Args"].body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)]
    assert len(fields) == len(entries) - 1 and all("\n" not in f.value.value for f in fields)


@pytest.mark.fast
def test_the_trl_baseline_passes_the_settings_its_table_states():
    """experiments/trl_grpo.py runs TRL's GRPOTrainer in an environment of its own, so TRL is not installed here: what
    it would pass to GRPOConfig is checked against docs/trl.md's table, and the ppo.py flags it gives for the same
    settings against what ppo.Args makes of them."""
    import importlib.util
    import tyro
    import ppo
    spec = importlib.util.spec_from_file_location("trl_grpo", "experiments/trl_grpo.py")
    trl_grpo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trl_grpo)
    a = trl_grpo.parser().parse_args(["--model", "M", "--dataset", "reasoning-gym:gcd", "--out", "x"])
    passed = trl_grpo.grpo_config_kwargs(a)
    stated = {name.strip("`"): value.strip("`") for name, value, *_ in table("docs/trl.md", "## The flag mapping")}
    assert stated == {name: repr(value) for name, value in passed.items()}
    args = tyro.cli(ppo.Args, args=["--model", "M", *trl_grpo.ppo_flags(a)])
    args.fill_defaults(1)
    P = passed
    assert (args.adv_estimator, args.group_size, args.group_std, args.loss_agg) == ("grpo", P["num_generations"], True,
                                                                                     "token-mean")
    assert P["loss_type"] == "bnpo" and P["scale_rewards"] == "group"
    assert args.batch_size == P["per_device_train_batch_size"] * P["steps_per_generation"] * P[
        "gradient_accumulation_steps"]
    assert (args.num_minibatches, args.num_ppo_epochs) == (P["steps_per_generation"], P["num_iterations"])
    assert args.total_episodes // args.batch_size * args.num_minibatches * args.num_ppo_epochs == P["max_steps"]
    assert (args.response_length, args.temperature, args.top_p, args.top_k) == (
        P["max_completion_length"], P["temperature"], P["top_p"], P["top_k"])
    assert (args.learning_rate, args.max_grad_norm, args.anneal_lr) == (P["learning_rate"], P["max_grad_norm"], True)
    assert args.clip_eps == P["epsilon"] == P["epsilon_high"] and args.clip_eps_high is None
    assert (args.kl_in_loss, args.kl_estimator, args.kl_coef) == (True, "k3", P["beta"]) and P["beta"] > 0
    assert (args.seed, args.precision, args.overlong_filter) == (P["seed"], "fp32", P["mask_truncated_completions"])
    assert args.missing_eos_penalty == a.missing_eos_penalty and args.max_tool_calls == P["max_tool_calling_iterations"]


def test_the_critic_experiment_evaluates_every_arm_on_questions_no_arm_trains_on():
    """experiments/run.py critic (issue 53): on each of its three tasks, every arm's training rows and the evaluator's
    rows are read through ppo.py's own loading, and no evaluation question (the guess world's: its secret) is one
    that any arm trains on; each arm samples as many tokens per update as its shape says."""
    import importlib.util
    import tyro
    import ppo
    spec = importlib.util.spec_from_file_location("run", "experiments/run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    for task in run.CRITIC_TASKS:
        evaluator = tyro.cli(ppo.Args, args=run.critic_flags(task, "grpo_4x4", 1, 1, 128, model="M"))
        evaluator.fill_defaults(1)
        env = ppo.load_python(evaluator.env, "--env") if evaluator.env else None
        asked = {ppo.question(r) for r in ppo.load_prompt_rows(evaluator, env)[1]}
        assert len(asked) == (len(run.GUESS_HELD_OUT) if task == "guess" else 128), task
        for arm, (estimator, questions, samples) in run.CRITIC_ARMS.items():
            args = tyro.cli(ppo.Args, args=run.critic_flags(task, arm, 2, 25, 128, model="M"))
            args.fill_defaults(1)
            trained = {ppo.question(r) for r in ppo.load_prompt_rows(args, env)[0]}
            assert len(trained) >= 16 - len(run.GUESS_HELD_OUT) and not trained & asked, (task, arm)
            assert (args.adv_estimator, args.batch_size // args.group_size, args.group_size) == (
                estimator, questions * (4 if task == "guess" else 1), samples)


@pytest.mark.fast
def test_no_flag_prints_its_default_twice():
    """An optional flag's help says what None does, so tyro's own "(default: None)" is left out; a flag with another
    default keeps tyro's note, and its help does not repeat the word."""
    import ppo
    out = subprocess.run([sys.executable, "ppo.py", "--help"], capture_output=True, text=True,
                         env=dict(os.environ, COLUMNS="300"), check=True).stdout
    assert "(default: None)" not in out and out.count("(default:") == sum(
        f.default is not None for f in dataclasses.fields(ppo.Args))
    helps = {n.target.id: d.value.value for n, d in zip(top_level()["Args"].body, top_level()["Args"].body[1:])
             if isinstance(n, ast.AnnAssign) and isinstance(d, ast.Expr)}
    for field in dataclasses.fields(ppo.Args):
        assert "None" in helps[field.name] if field.default is None else "default" not in helps[field.name], field.name


@pytest.mark.fast
def test_no_doc_names_a_path_outside_the_repository():
    """A user has the repository alone: every ../path a doc names lies inside it and exists."""
    root = os.path.abspath(".")
    for path in DOCS:
        for target in re.findall(r"(?:\.\./)+[\w./-]*\w", open(path).read()):
            where = os.path.abspath(os.path.join(os.path.dirname(path), target))
            assert where.startswith(root + os.sep) and os.path.exists(where), f"{path} names {target}"


@pytest.mark.fast
def test_the_readme_tells_a_newcomer_what_the_code_does():
    readme = open("README.md").read()
    fork = readme.split("## How to fork it")[1].split("\n## ")[0]
    copy = ("ppo.py", "gae.py", "adapters.py", "runfiles.py", "asyncsampler.py", "toy.py")  # all a fork copies
    assert all(f"`{name}`" in fork.split(";")[0] for name in copy)
    setup = readme.split("## Two commands")[1].split("**What you will see.**")[0]
    assert "vLLM is optional" in setup and "skip without it" in setup
    # the toy's time, measured once and said once: in the README, and nowhere else with another figure
    assert len(re.findall(r"\d+ s of training", readme)) == 1
    for path in ("ppo.py", "toy.py"):
        assert "minute" not in open(path).read().split('"""')[1], path  # (their docstrings)
    assert "minute" not in readme.split("## Two commands")[0]
    # the variants on by default are named where the README says the others are off
    import ppo
    defaults = ppo.Args()
    variants = readme.split("Every variant the literature argues about")[1].split("\n\n")[0]
    assert defaults.missing_eos_penalty is not None and "--missing-eos-penalty" in variants
    assert defaults.value_clip_eps is not None and "value clip" in variants


@pytest.mark.fast
def test_every_mutant_names_text_that_occurs_once_in_its_file():
    """tests/mutants.py stops at a mutant whose text has moved: a stale mutant is a hole the mutation check never
    probes, found here at once rather than in its slow run."""
    from mutants import MUTANTS, MUTATED
    assert len({m[0] for m in MUTANTS}) == len(MUTANTS), "two mutants share a name"
    for name, path, old, new in MUTANTS:
        assert path in MUTATED and old != new, name
        assert open(path).read().count(old) == 1, f"{name}: its text occurs {open(path).read().count(old)}x in {path}"
