"""Tool calls (issue 64): the sandbox (sandbox.py), each hostile call contained within its limits and reported in the
tool's result, this process (the trainer's place) and its files untouched; the tools and their parsing (tools.py);
--tools runs with the critic, GRPO's groups, the vLLM engine, a resume and 2 ranks; TRL's rendering and parsing."""
import collections
import os
import shutil
import socket
import subprocess
import time

import pytest

import sandbox

SANDBOX = sandbox.__file__  # its `python` tool: runs the model's code
HELD = sandbox.can_hold()  # what this machine lets a process close (sandbox.py's table): a step it lacks is skipped
LIMITS = sandbox.Limits(wall_s=4, cpu_s=2, memory_mb=512, processes=8, output_bytes=4096)


def call(code, limits=LIMITS):
    t0 = time.monotonic()
    result = sandbox.run(SANDBOX, "python", {"code": code}, limits)
    return result, time.monotonic() - t0


def sandbox_processes():
    """The pids of processes running sandbox.py's child (a call's leftovers if any)."""
    out = subprocess.run(["pgrep", "-f", f"{SANDBOX} [0-9]"], capture_output=True, text=True).stdout
    return out.split()


@pytest.mark.fast
def test_a_call_runs_clean_in_a_folder_of_its_own_that_is_removed_after():
    """A plain call answers what it printed; it starts with no inherited environment variable (the trainer's
    secrets, WANDB_API_KEY say) and in an empty folder of its own, which it may write and which is gone after."""
    os.environ["PPO_TOOL_SECRET"] = "s3cret"
    try:
        result, _ = call("import os, json\nopen('note.txt', 'w').write('kept')\n"
                         "print(json.dumps([os.getcwd(), sorted(os.listdir('.')), open('note.txt').read(), "
                         "'PPO_TOOL_SECRET' in os.environ]))")
    finally:
        del os.environ["PPO_TOOL_SECRET"]
    assert result.status == "ok", result
    import json
    folder, files, note, secret = json.loads(result.text)
    assert files == ["note.txt"] and note == "kept" and not secret
    assert not os.path.exists(folder)
    assert sandbox.run(SANDBOX, "python", {"code": "print(6 * 7)"}).text == "42\n"
    assert sandbox.held() == HELD  # a call takes every step this machine allows


def needs(*steps):
    missing = set(steps) - HELD
    return pytest.mark.skipif(bool(missing), reason=f"this machine does not let a process close {sorted(missing)}")


HOSTILE = {  # name: (code, the result's status, a word its text must hold)
    "an infinite loop": ("while True:\n    pass", "limit", "CPU-time"),  # (its own wall clock: 30 s, below)
    "a sleep past the wall clock": ("import time\ntime.sleep(60)", "timeout", "4 s limit"),
    "a fork bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
                    ("timeout", "limit"), "limit"),
    "allocating 20 GB": ("x = bytearray(20 * 2**30)", "limit", "memory"),
    "printing 1 GB": ("import sys\nfor _ in range(1024):\n    sys.stdout.write('x' * 2**20)", "limit", "4096 bytes"),
    "raising": ("raise ValueError('no such thing')", "error", "ValueError: no such thing"),
    "killing its parent": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)", "error",
                           "Operation not permitted"),
}
NEEDS = {"a fork bomb": "processes", "killing its parent": "signals"}  # (unsafe to try where they do not hold)


@pytest.mark.parametrize("name", [pytest.param(n, marks=needs(NEEDS[n])) if n in NEEDS else n for n in HOSTILE])
def test_a_hostile_call_is_contained_and_reported(name):
    code, status, word = HOSTILE[name]
    before = set(sandbox_processes())
    limits = sandbox.Limits(**{**vars(LIMITS), "wall_s": 30, "cpu_s": 1}) if name == "an infinite loop" else LIMITS
    result, seconds = call(code, limits)
    assert result.status in (status if isinstance(status, tuple) else (status,)), result
    assert word in result.text and result.text.startswith("error:"), result
    assert seconds < limits.wall_s + 3  # (stopped at its limit, not left to run)
    assert set(sandbox_processes()) <= before  # nothing it started outlives the call (the fork bomb's children)


@pytest.mark.fast
@needs("files")
def test_a_call_reads_and_writes_nothing_outside_its_folder(tmp_path):
    """The run's own files (this repository's), the user's home and any other folder are closed to it, for reading,
    listing and writing; every attempt is an error text, and nothing outside changes."""
    secret = tmp_path / "checkpoint.txt"
    secret.write_text("weights")
    home = os.path.expanduser("~")
    targets = {"read": f"print(open({str(secret)!r}).read())", "list": f"print(os.listdir({home!r}))",
               "source": f"print(open({os.path.abspath('ppo.py')!r}).read()[:20])",
               "write": f"open({str(tmp_path / 'new.txt')!r}, 'w').write('x')",
               "overwrite": f"open({str(secret)!r}, 'w').write('gone')",
               "remove": f"os.remove({str(secret)!r})"}
    for what, code in targets.items():
        result, _ = call("import os\n" + code)
        assert result.status == "error" and "PermissionError" in result.text, (what, result)
    assert secret.read_text() == "weights" and sorted(os.listdir(tmp_path)) == ["checkpoint.txt"]


@pytest.mark.fast
def test_what_a_tool_returns_or_is_called_with_wrongly_is_an_error_text(tmp_path):
    """A tool (a function of a tools file) returning what JSON cannot hold, or called with an unknown argument: an
    error text for the model, the caller goes on; a value it returns is its result, as JSON."""
    tools = tmp_path / "tools.py"
    tools.write_text("def add(a: int, b: int) -> int:\n    return a + b\n\n"
                     "def weird() -> object:\n    return object()\n\n"
                     "def nan() -> float:\n    return float('nan')\n")
    assert sandbox.run(str(tools), "add", {"a": 2, "b": 3}).text == "5"
    for name, arguments, word in (("weird", {}, "JSON cannot hold"), ("nan", {}, "JSON cannot hold"),
                                  ("add", {"a": 1, "c": 2}, "unexpected keyword argument")):
        result = sandbox.run(str(tools), name, arguments)
        assert result.status == "error" and word in result.text, result


@pytest.mark.fast
@needs("network namespace")
def test_a_call_reaches_no_network():
    """A TCP server and a UDP socket listening on this machine's loopback: the call can neither connect to the one
    nor send to the other (each attempt an error text), and neither hears from it."""
    with socket.create_server(("127.0.0.1", 0)) as server, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.bind(("127.0.0.1", 0))
        server.settimeout(0.5), udp.settimeout(0.5)
        for code in (f"import socket\nsocket.create_connection(('127.0.0.1', {server.getsockname()[1]}), timeout=2)"
                     ".sendall(b'hello')",
                     f"import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'hello', "
                     f"('127.0.0.1', {udp.getsockname()[1]}))"):
            result, _ = call(code)
            assert result.status == "error" and "Error" in result.text, result
        with pytest.raises(socket.timeout):
            server.accept()
        with pytest.raises(socket.timeout):
            udp.recv(16)


@pytest.mark.fast
@needs("processes")
def test_a_call_starts_at_most_its_processes_and_none_outlive_it():
    """A call that forks 100 sleeping children gets at most `processes` - 1 of them (itself counts), and none is
    left once the call has answered."""
    code = ("import os, time\nn = 0\nfor _ in range(100):\n    try:\n        if os.fork() == 0:\n"
            "            time.sleep(60)\n            os._exit(0)\n        n += 1\n    except OSError:\n        break\n"
            "print(n)")
    before = set(sandbox_processes())
    result, _ = call(code)
    assert result.status == "ok" and 0 < int(result.text) < LIMITS.processes, result
    assert set(sandbox_processes()) <= before


TOOLS_FILE = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def weird() -> dict:
    """A value JSON cannot hold."""
    return {"x": float("nan")}


def no_doc(a: int) -> int:
    return a


def no_hints(a):
    """Echo.

    Args:
        a: anything
    """
    return a
'''


@pytest.mark.fast
def test_tools_load_with_their_schemas_and_bad_ones_are_refused_in_one_line(tmp_path):
    """--tools FILE.py:NAME,...: functions with hints and docstrings load with transformers' JSON schema (sandbox.py's
    `python` among them); a file that does not load, a missing name, a function without a docstring or hints are
    refused in one line naming it."""
    import tools
    path = tmp_path / "my_tools.py"
    path.write_text(TOOLS_FILE)
    add, python = tools.load(f"{path}:add,python")
    assert tools.schema(add)["function"]["parameters"]["properties"] == {
        "a": {"type": "integer", "description": "the first"}, "b": {"type": "integer", "description": "the second"}}
    assert python is sandbox.python and python.run_apart and not getattr(add, "run_apart", False)
    (tmp_path / "broken.py").write_text("def f(:\n")
    for spec, words in ((f"{tmp_path}/broken.py:f", "does not load"), (f"{path}:subtract", "no function 'subtract'"),
                        (f"{path}:no_doc", "no_doc"), (f"{path}:no_hints", "no_hints"), (str(path), "FILE.py:NAME")):
        with pytest.raises(ValueError, match=words) as e:
            tools.load(spec)
        assert "\n" not in str(e.value)


@pytest.mark.fast
def test_calls_are_parsed_from_the_hermes_form_and_bad_ones_answered_with_an_error(tmp_path):
    """The Hermes / Qwen 2.5 form: each <tool_call>{json}</tool_call> is a call; malformed JSON, a call without a
    name or with arguments that are not an object, a call to a tool that does not exist and arguments of the wrong
    types each come back as an error text; a thousand calls in one response run the first `max_calls` and answer the
    rest with one error."""
    import tools
    from transformers import AutoTokenizer
    path = tmp_path / "my_tools.py"
    path.write_text(TOOLS_FILE)
    loaded = tools.load(f"{path}:add,weird")
    tokenizer = AutoTokenizer.from_pretrained(__import__("real_models").tokenizer_dir("qwen2"))
    call = lambda body: f"<tool_call>\n{body}\n</tool_call>"  # noqa: E731
    text = ("Let me add. " + call('{"name": "add", "arguments": {"a": 2, "b": 3}}') + call("{not json}")
            + call('{"arguments": {}}') + call('{"name": "add", "arguments": "[1]"}')
            + call('{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 1}"}'))
    calls = tools.parse(tokenizer, text, "", [], max_calls=8)
    assert [(c.name, c.arguments, c.error is None) for c in calls] == [
        ("add", {"a": 2, "b": 3}, True), ("", {}, False), ("", {}, False), ("add", {}, False),
        ("add", {"a": 1, "b": 1}, True)]
    assert "not valid JSON" in calls[1].error and "\"name\"" in calls[2].error and "JSON object" in calls[3].error
    results = [tools.run(loaded, c) for c in calls]
    assert [r.text for r in (results[0], results[4])] == ["5", "2"]
    assert all(r.status == "error" and r.text.startswith("error:") for r in results[1:4])
    for c, words in ((tools.Call("subtract", {}), "no tool is named 'subtract'"),
                     (tools.Call("add", {"a": "2", "b": 3}), "'a' must be integer, not str"),
                     (tools.Call("add", {"a": True, "b": 3}), "'a' must be integer, not bool"),
                     (tools.Call("add", {"a": 2}), "'b' is missing"),
                     (tools.Call("add", {"a": 2, "b": 3, "c": 4}), "no argument 'c'"),
                     (tools.Call("weird", {}), "JSON cannot hold")):
        result = tools.run(loaded, c)
        assert result.status == "error" and words in result.text, (c, result)
    many = tools.parse(tokenizer, call('{"name": "add", "arguments": {"a": 1, "b": 2}}') * 1000, "", [], max_calls=4)
    assert len(many) == 5 and all(c.error is None for c in many[:4]) and "996 more tool calls" in many[4].error


# a ChatML template that takes tools, written here (the four tokenizers of tests/tokenizers ship none that does)
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>. "
    "The tools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n"
    "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ANSWER_FN = '''
def exact(prompts, responses, answer):
    """1 where the response's last word is the answer."""
    return [float(bool(r.split()) and r.split()[-1] == a) for r, a in zip(responses, answer)]
'''


CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


def calling_policy():
    """The tiny Qwen2 chat model (tests/real_models.py) with TOOL_TEMPLATE, taught by a few hundred steps of SFT to
    make a call on its first turn (always CALL) and to answer 3 once the result is back: episodes of two turns with a
    tool message between, for the runs below. The loss is on the model's own tokens only, and the head runs on
    those alone (Qwen2's vocabulary is 151k). Built once, under runs/real/qwen2-calls."""
    import json
    import random
    import real_models
    import tools
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = os.path.join(real_models.ROOT, "qwen2-calls")
    if os.path.exists(os.path.join(path, "done.json")):
        return path
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(real_models.build("qwen2"), path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = TOOL_TEMPLATE
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, "my_tools.py"), "w") as f:
        f.write(TOOLS_FILE)
    schemas = [t.schema for t in tools.load(f"{path}/my_tools.py:add,python")]
    model, rng = AutoModelForCausalLM.from_pretrained(path), random.Random(0)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for _ in range(200):
        chat = [{"role": "user", "content": f"What is {rng.randrange(10)} + {rng.randrange(10)}?"}]
        prompt = ids(tokenizer.apply_chat_template(chat, tools=schemas, add_generation_prompt=True, tokenize=False))
        with_call = chat + [{"role": "assistant", "content": CALL}]
        result = ids(tokenizer.apply_chat_template(with_call + [{"role": "tool", "content": "3"}], tools=schemas,
                                                   add_generation_prompt=True, tokenize=False))
        x = result + ids("3") + [end]  # the whole episode; the model's tokens: CALL <|im_end|>, then 3 <|im_end|>
        mine = list(range(len(prompt) - 1, len(prompt) + len(ids(CALL)))) + list(range(len(result) - 1, len(x) - 1))
        hidden = model.model(torch.tensor([x])).last_hidden_state[0, mine]  # (n, H)
        loss = torch.nn.functional.cross_entropy(model.lm_head(hidden), torch.tensor([x[i + 1] for i in mine]))
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.config.max_position_embeddings = 1024  # (RoPE: no learned positions; vLLM caps its context at this)
    model.save_pretrained(path)
    json.dump({"sft_loss": loss.item()}, open(os.path.join(path, "done.json"), "w"))
    return path


@pytest.fixture(scope="module")
def tool_files(tmp_path_factory):
    """A tiny chat model on Qwen2's real tokenizer with TOOL_TEMPLATE, a tools file, a reward and a prompt set."""
    import json
    root = tmp_path_factory.mktemp("tools")
    shutil.copytree(calling_policy(), root / "policy")
    (root / "my_tools.py").write_text(TOOLS_FILE)
    (root / "reward.py").write_text(ANSWER_FN)
    with open(root / "prompts.jsonl", "w") as f:
        f.writelines(json.dumps({"prompt": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n"
                     for a in range(10) for b in range(10))
    return root


@pytest.mark.fast
def test_an_episode_runs_the_calls_and_the_template_renders_their_results(tool_files):
    """tools.episodes as ppo.py plays it: the schemas in the rendered prompt; a response with a call gets the tool's
    result back as a tool message, appended as the chat template renders it after the sampled turn; a response
    without a call ends the episode with the task's score of that answer; the calls are counted."""
    import ppo
    import tools
    from transformers import AutoTokenizer
    args = ppo.Args(model=str(tool_files / "policy"), tools=f"{tool_files}/my_tools.py:add",
                    reward_fn=f"{tool_files}/reward.py:exact", dataset=str(tool_files / "prompts.jsonl"),
                    max_prompt_length=256)  # (the tools' schemas take room)
    ppo.check_args(args, 1)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    Episode = tools.episodes(args, tokenizer, ppo.fail, lambda p, t, c: float(t.split()[-1] == c["answer"][0]))
    env = Episode()
    chat, prompt = ppo.first_observation(tokenizer, env.reset({"prompt": "What is 2 + 3?", "answer": "5"}, 0), args)
    assert '"name": "add"' in tokenizer.decode(prompt) and tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")
    tools.COUNTS.clear()
    said = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    observation, reward, done = env.step(said)
    assert observation == [{"role": "tool", "name": "add", "content": "5"}] and (reward, done) == (0.0, False)
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")  # the sampled turn ended with it
    ids = ppo.observation_ids(tokenizer, chat, said, observation, stop, args, 1)
    assert tokenizer.decode(ids) == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n" \
                                   "<|im_start|>assistant\n"
    assert env.step("It is 5") == (None, 1.0, True)
    assert tools.counts("tools/") == {"tools/calls": 1, "tools/errors": 0, "tools/timeouts": 0, "tools/called": 1}
    assert not tools.COUNTS
    for said in ('<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>', said, "5"):  # a call that fails is
        env.reset({"prompt": "What is 2 + 3?", "answer": "5"}, 0)                          # not one that ran clean
        env.step(said), env.step("5")
    assert tools.counts("") == {"calls": 2 / 3, "errors": 1 / 3, "timeouts": 0, "called": 1 / 3}


def tool_flags(root):
    return dict(model=str(root / "policy"), tools=f"{root}/my_tools.py:add,python", reward_fn=f"{root}/reward.py:exact",
                dataset=str(root / "prompts.jsonl"), response_length=32, max_tool_calls=2, eval_size=8,
                micro_batch_size=8, max_prompt_length=256, learning_rate=1e-5)


def tool_results_off_the_loss(rollout, tokenizer):
    """Each episode of a rollout: the model's own tokens (mask 1) hold no tool result; the tokens between its turns
    (mask 0) are the template's tool messages, at most one for each call the model began (a call on the last turn
    allowed runs not), the taught call's result after it. Returns how many episodes had one."""
    P = rollout.query_responses.shape[1] - rollout.mask.shape[1]
    n = 0
    for b in range(rollout.mask.shape[0]):
        ids = rollout.query_responses[b, P:P + int(rollout.lengths[b])].tolist()
        mask = rollout.mask[b, :len(ids)].tolist()
        own = tokenizer.decode([i for i, m in zip(ids, mask) if m])
        between = tokenizer.decode([i for i, m in zip(ids, mask) if not m])
        assert "<tool_response>" not in own and mask[0] == 1 and mask[-1] == 1
        messages = between.count("<tool_response>")
        assert messages == between.count("</tool_response>") and (1 <= messages <= own.count("<tool_call>")
                                                                   if between else True)
        if own.startswith(CALL + "<|im_end|>"):  # a first turn that made the call the model was taught: its result
            assert between.startswith("\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>")
        n += bool(between)
    return n


def test_a_run_with_tools_trains_and_refuses_what_it_cannot_do(tool_files, monkeypatch):
    """ppo.py --tools on the tiny Qwen2 chat model taught to call, GAE with the critic: the prompts the model is given
    carry the tools' schemas; calls run and their results come back between the turns, off the loss; the run logs
    tools/ and env/turns; --tools with --env, without --reward-fn, or on a model whose template takes no tools is
    refused in one line."""
    import ppo
    from test_in_process import run_main
    from test_less_work import rollouts_logged
    seen = rollouts_logged(monkeypatch)
    flags = tool_flags(tool_files)
    rows = run_main("test_tools_run", total_episodes=16, batch_size=8, **flags)
    assert len(rows) == 2 and all(r["tools/called"] > 0 and r["tools/calls"] >= r["tools/called"]
                                  and 1 <= r["env/turns"] <= 3 for r in rows)
    tokenizer = ppo.AutoTokenizer.from_pretrained(flags["model"])
    prompt = tokenizer.decode(seen[0].query_responses[0])
    assert '"name": "add"' in prompt and '"name": "python"' in prompt
    assert all(tool_results_off_the_loss(r, tokenizer) > 0 for r in seen)
    for bad, words in ((dict(env="tests/envs.py:Replies"), "no --env"), (dict(reward_fn=None), "add --reward-fn"),
                       (dict(model="toy"), "never reads `tools`")):
        with pytest.raises(ppo.UsageError, match=words) as e:
            run_main("test_tools_bad", **{**flags, **bad})
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("mode", ["grpo", "vllm"])
def test_tool_episodes_with_the_group_estimators_and_the_vllm_engine(tool_files, monkeypatch, mode):
    """--tools with GRPO's groups (no critic) on the HF sampler, and with the vLLM engine sampling every turn: the
    calls run, their results come back between the turns, off the loss."""
    import ppo
    from test_in_process import run_main
    from test_less_work import rollouts_logged
    if mode == "vllm":
        pytest.importorskip("vllm")
    seen = rollouts_logged(monkeypatch)
    flags = {**tool_flags(tool_files), **(dict(adv_estimator="grpo", group_size=4) if mode == "grpo" else
                                           dict(vllm=True))}
    rows = run_main(f"test_tools_{mode}", total_episodes=16, batch_size=8, **flags)
    assert len(rows) == 2 and all(r["tools/called"] > 0 for r in rows)
    tokenizer = ppo.AutoTokenizer.from_pretrained(flags["model"])
    assert all(tool_results_off_the_loss(r, tokenizer) > 0 for r in seen)


def cli(flags):
    return [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]


def test_a_run_with_tools_resumes_exactly_and_runs_on_two_ranks_as_on_one(tool_files):
    """Killed once its checkpoint of update 1 is in place, mid-update 2 (its episodes' calls in flight), and resumed:
    the rows of the straight run, tools/ among them (the killed update's episodes are played again, their calls
    counted once). Under torchrun on 2 ranks (gloo), each playing half the episodes: the one-rank run's rows within
    fp32's rounding (tests/test_sharded.py), the calls per episode the same."""
    from test_resume import metrics, straight_and_resumed
    from test_sharded import assert_same_run, torchrun
    flags = cli({**tool_flags(tool_files), "total_episodes": 16, "batch_size": 8, "micro_batch_size": 4,
                 "save_every": 1, "sample_every": 0})
    runs = straight_and_resumed("test_tools_resume", flags)
    straight, resumed = ([{k: v for k, v in r.items() if not k.startswith(("time/", "mem/"))} for r in metrics(run)]
                         for run in runs)
    assert resumed == straight and len(straight) == 2 and all(r["tools/called"] > 0 for r in straight)
    shutil.rmtree("runs/test_tools_two", ignore_errors=True)
    out = torchrun(2, "ppo.py", "--run-name", "test_tools_two", *flags)
    assert out.returncode == 0, out.stderr[-3000:]
    assert_same_run(metrics("test_tools_two"), metrics(runs[0]))


@pytest.mark.fast
def test_the_prompt_the_calls_and_the_tool_message_are_those_of_trl_grpo_trainer():
    """tests/trl_tools.json (TRL 1.12's GRPOTrainer with tools=, recorded by tests/trl_tools.py): the same prompt ids
    for the tool task's rows, the same calls read from the same outputs, the same ids after a call. Where the two
    differ, it is by design, and asserted: a call TRL cannot read (malformed JSON, no name) TRL takes for a final
    answer and ends the episode, tools.py answers with an error for the model to read; arguments written as a JSON
    string TRL passes on as a string (the call then fails), tools.py decodes."""
    import json
    import ppo
    import real_models
    import smollm2
    import tools
    from transformers import AutoTokenizer
    fixture = json.load(open(os.path.join(os.path.dirname(__file__), "trl_tools.json")))
    tokenizer = AutoTokenizer.from_pretrained(real_models.tokenizer_dir("qwen2"))
    tokenizer.chat_template = smollm2.TOOLS_TEMPLATE
    args = ppo.Args(model="qwen2", tools=os.path.join(os.path.dirname(__file__), "trl_tools.py:calculator,add"),
                    reward_fn="smollm2.py:calc_reward", max_prompt_length=768)
    env = tools.episodes(args, tokenizer, ppo.fail, None)()  # (the tokenizer now renders the tools' schemas)
    for p in fixture["prompts"]:
        assert ppo.render_prompt(tokenizer, env.reset({"prompt": p["messages"]}, 0)) == p["ids"]
    kinds = collections.Counter()
    for out in fixture["outputs"]:
        ours, theirs = tools.parse(tokenizer, out["text"], "", None, 8), out["calls"]
        if theirs and all(isinstance(c["arguments"], dict) for c in theirs):
            kinds["same"] += 1
            assert [(c.name, c.arguments, c.error) for c in ours] == [(c["name"], c["arguments"], None) for c in theirs]
        elif theirs:
            kinds["arguments as a string"] += 1
            assert [(c.name, c.arguments) for c in ours] == [(c["name"], json.loads(c["arguments"])) for c in theirs]
        elif ours:
            kinds["an error, not an answer"] += 1
            assert len(ours) == 1 and ours[0].error and "<tool_call>" in out["text"]
        else:
            kinds["no call"] += 1
    assert kinds == {"same": 6, "arguments as a string": 1, "an error, not an answer": 2, "no call": 3}, kinds
    chat, _ = ppo.first_observation(tokenizer, fixture["prompts"][0]["messages"], args)
    said = fixture["outputs"][0]["text"]
    tool_message = [{"role": "tool", "name": "calculator", "content": "3957283"}]
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert ppo.observation_ids(tokenizer, chat, said, tool_message, stop, args, 1) == fixture["tool_suffix"]
