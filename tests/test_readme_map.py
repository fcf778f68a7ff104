"""The README's map of ppo.py and its table of variant flags say where things are, and stay true.

    python tests/test_readme_map.py     # rewrites both tables in README.md as ppo.py stands
"""
import ast
import re

import pytest

pytestmark = pytest.mark.fast
MAP_HEADING, VARIANTS_HEADING = "## Reading ppo.py", "## One flag per idea"


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
        end = (nxt[0] if nxt else len(lines) + 1) - 1
        while not lines[end - 1].strip():
            end -= 1
        out.append((title, start, end, level))
    return out


def variant_reads(flag, path="ppo.py"):
    """The lines of ppo.py that read `args.<flag>`, as the README writes them: 12, 40-41 (`no_x`: tyro's
    negation of a boolean field `x`)."""
    if flag.startswith("no_") and f"args.{flag}" not in open(path).read():
        flag = flag[3:]
    hits = [i for i, line in enumerate(open(path).read().splitlines(), 1) if re.search(rf"args\.{flag}\b", line)]
    runs = []
    for i in hits:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def readme_table(heading):
    text = open("README.md").read()
    assert heading in text, heading
    block = text.split(heading, 1)[1].split("\n## ", 1)[0]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in block.splitlines()
            if line.startswith("|") and not line.startswith("|---")][1:]


def map_rows():
    return [(f"{start}-{end}", ("" if level == 1 else "&nbsp;&nbsp;") + title)
            for title, start, end, level in sections()]


def test_the_map_in_the_readme_matches_the_banners_of_ppo_py():
    rows = [tuple(r[:2]) for r in readme_table(MAP_HEADING)]
    assert rows == map_rows(), "README map out of date: run python tests/test_readme_map.py"
    # the order the issue asks for: flags, the algorithm, main and its loop, then the plumbing
    majors = [t.split(":")[0].split(",")[0] for t, _, _, level in sections() if level == 1]
    assert majors == ["docstring and imports", "Flags", "The algorithm", "main", "Plumbing"]


def test_the_variant_table_names_the_lines_that_read_each_flag():
    rows = readme_table(VARIANTS_HEADING)
    assert len(rows) >= 15
    for row in rows:
        flag = re.match(r"`--([\w-]+)", row[0]).group(1).replace("-", "_")
        assert row[-1] == variant_reads(flag), f"--{flag}: README says {row[-1]}, ppo.py reads it at {variant_reads(flag)}"


def test_the_training_loop_comes_first_and_main_stays_short():
    lines = open("ppo.py").read().splitlines()
    main = next(i for i, line in enumerate(lines) if line.startswith("def main("))
    end = next(i for i in range(main + 1, len(lines)) if lines[i] and not lines[i].startswith((" ", "#")))
    body = lines[main:end]
    loop = next(i for i, line in enumerate(body) if line.startswith("    for update in "))
    loop_end = next(i for i in range(loop + 1, len(body)) if body[i].startswith("    ") and not body[i].startswith("     "))
    assert main + loop_end < 1300, "the training loop must end before line 1,300"
    assert len(body) <= 220 and loop_end - loop <= 150, (len(body), loop_end - loop)
    assert not any(re.match(r"\s+def ", x) for x in body), "no function defined inside main"
    assert max(map(len, lines)) <= 120


# what the algorithm's functions may still call below `main`: the engine, the reward sources, the env's checked
# calls and the chat template's rendering, the packing of the sampler's support, the chunked head's kernels, and
# the one-line error
PLUMBING = {"fail", "rank_and_world", "vllm_generate", "reward_fn_scores", "reward_model_scores", "render_for_rm",
            "env_call", "env_step", "first_observation", "observation_ids", "question",
            "pick", "join", "sampling_support", "dense_support", "pack_support", "kept_pairs", "head_chunk", "HeadLogprobs"}


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


def rewrite_readme():
    """The map's rows and the variant table's last column, as ppo.py stands."""
    text = open("README.md").read()
    head, rest = text.split(MAP_HEADING, 1)
    body, tail = rest.split("\n## ", 1)
    table = "| lines | section |\n|---|---|\n" + "".join(f"| {a} | {b} |\n" for a, b in map_rows())
    body = re.sub(r"\| lines \| section \|\n(\|.*\n)+", table, body)
    text = head + MAP_HEADING + body + "\n## " + tail

    def fix(line):
        if not line.startswith("| `--"):
            return line
        cells = line.split(" | ")
        flag = re.match(r"\| `--([\w-]+)", line).group(1).replace("-", "_")
        return " | ".join(cells[:-1] + [variant_reads(flag) + " |"])
    head, rest = text.split(VARIANTS_HEADING, 1)
    body, tail = rest.split("\n## ", 1)
    text = head + VARIANTS_HEADING + "\n".join(map(fix, body.split("\n"))) + "\n## " + tail
    open("README.md", "w").write(text)


if __name__ == "__main__":  # python tests/test_readme_map.py: bring the README's two tables up to date
    rewrite_readme()
