"""Tool calls (issue 64): the tools a model may call, what its chat template is given of them, the calls parsed from
its output, and each call run, apart in sandbox.py where the tool runs code. Plumbing beside ppo.py.

    tools = load("my_tools.py:add,python")     # functions with type hints and docstrings (sandbox.python too)
    schemas = [schema(t) for t in tools]        # transformers' get_json_schema: apply_chat_template(tools=schemas)
    calls = parse(tokenizer, text, prefix, schemas, max_calls=8)    # the model's calls, or an error for each bad one
    results = [run(tools, call) for call in calls]                  # each a sandbox.Result: its text goes back
"""
import collections
import dataclasses
import functools
import importlib.util
import json
import os
import re

import sandbox

HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)  # Hermes / Qwen 2.5's form of a call
COUNTS = collections.Counter()  # --tools: the episodes, calls, errors and timeouts since counts() last read them
JSON_TYPES = {"integer": int, "number": (int, float), "string": str, "boolean": bool, "array": list, "object": dict,
              "null": type(None)}


@dataclasses.dataclass
class Call:
    name: str
    arguments: dict
    error: str = None  # why the call cannot run (malformed, past --max-tool-calls): the model reads this instead


def load(spec):
    """`FILE.py:NAME[,NAME...]` -> the functions, each checked for what its JSON schema needs (type hints, a
    docstring with each argument): a ValueError of one line otherwise. A name defined in sandbox.py (`python`) is
    taken from there when the file lacks it."""
    path, _, names = spec.rpartition(":")
    if not path or not names:
        raise ValueError(f"--tools {spec!r}: expected FILE.py:NAME[,NAME...]")
    try:
        spec_ = importlib.util.spec_from_file_location(f"tools_{abs(hash(path))}", path)
        module = importlib.util.module_from_spec(spec_)
        spec_.loader.exec_module(module)
    except (OSError, SyntaxError, ImportError, AttributeError) as e:
        raise ValueError(f"--tools {path} does not load: {type(e).__name__}: {e}".splitlines()[0]) from None
    tools = []
    for name in names.split(","):
        fn = getattr(module, name, None) or (getattr(sandbox, name, None) if name == "python" else None)
        if not callable(fn):
            raise ValueError(f"--tools {path} has no function {name!r}")
        try:
            fn.schema = schema(fn)  # (read by the template and by each call's argument check)
        except Exception as e:  # transformers' DocstringParsingException, TypeHintParsingException
            raise ValueError(f"--tools {path}:{name}: {str(e).splitlines()[0]} (a tool needs type hints and a "
                             "docstring with an Args: line for each argument)") from None
        fn.tool_path = os.path.abspath(sandbox.__file__ if fn is getattr(sandbox, name, None) else path)
        tools.append(fn)
    return tools


def schema(fn):
    from transformers.utils import get_json_schema
    return get_json_schema(fn)


def apart(fn):
    """Mark a tool to run in the sandbox (sandbox.py), as the `python` tool always does."""
    fn.run_apart = True
    return fn


sandbox.python.run_apart = True


def parse(tokenizer, text, prefix, schemas, max_calls):
    """The calls in one response: by the tokenizer's own response template where it has one (transformers'
    parse_response), else the Hermes form <tool_call>{"name": ..., "arguments": {...}}</tool_call>. A call that
    cannot be read, and each past `max_calls`, keeps an error for the model."""
    if getattr(tokenizer, "response_template", None):
        message = tokenizer.parse_response(text, prefix=prefix, tools=schemas)
        found = [c.get("function", c) for c in message.get("tool_calls") or []]
    else:
        found = []
        for body in HERMES.findall(text):
            try:
                found.append(json.loads(body))
            except ValueError as e:
                found.append(Call("", {}, f"the tool call is not valid JSON ({e})"))
    calls = []
    for c in found:
        if isinstance(c, Call):
            calls.append(c)
        elif not isinstance(c, dict) or not isinstance(c.get("name"), str):
            calls.append(Call("", {}, "a tool call must be an object with a \"name\" and \"arguments\""))
        else:
            arguments = c.get("arguments", {})
            if isinstance(arguments, str):  # (some templates write the arguments as a JSON string)
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    pass
            calls.append(Call(c["name"], arguments) if isinstance(arguments, dict) else
                         Call(c["name"], {}, "the arguments of a tool call must be a JSON object"))
    if len(calls) > max_calls:  # (one error for the rest, not one each: a thousand would fill the context)
        calls = calls[:max_calls] + [Call("", {}, f"{len(calls) - max_calls} more tool calls in this response were "
                                                  f"not run: at most {max_calls} a response")]
    return calls


def run(tools, call, limits=sandbox.Limits()):
    """One call -> sandbox.Result. An unknown tool or arguments that do not fit its schema are an error text;
    a tool marked to run apart (the `python` tool among them) runs in the sandbox, any other in this process."""
    if call.error:
        return sandbox.Result(f"error: {call.error}", "error")
    fn = next((t for t in tools if t.__name__ == call.name), None)
    if fn is None:
        return sandbox.Result(f"error: no tool is named {call.name!r} (the tools: "
                              f"{', '.join(t.__name__ for t in tools)})", "error")
    wrong = argument_error(fn.schema["function"]["parameters"], call.arguments)
    if wrong:
        return sandbox.Result(f"error: {call.name}: {wrong}", "error")
    if getattr(fn, "run_apart", False):
        return sandbox.run(fn.tool_path, call.name, call.arguments, limits)
    try:  # (a tool not marked apart is the user's own code, trusted as a reward function is)
        value = fn(**call.arguments)
    except Exception as e:  # noqa: BLE001  (the tool's own failure is the model's to read)
        return sandbox.Result(f"error: {type(e).__name__}: {e}", "error")
    if isinstance(value, str):
        return sandbox.Result(value, "ok")
    try:
        return sandbox.Result(json.dumps(value, allow_nan=False), "ok")
    except (TypeError, ValueError) as e:
        return sandbox.Result(f"error: the tool returned what JSON cannot hold ({type(value).__name__}: {e})", "error")


def argument_error(parameters, arguments):
    """Why `arguments` do not fit a JSON schema's parameters (a missing required one, an unknown one, a value of
    another JSON type), or None."""
    properties = parameters.get("properties", {})
    for name in parameters.get("required", []):
        if name not in arguments:
            return f"the argument {name!r} is missing"
    for name, value in arguments.items():
        if name not in properties:
            return f"there is no argument {name!r} (the arguments: {', '.join(properties)})"
        kind = properties[name].get("type")
        kinds = kind if isinstance(kind, list) else [kind] if kind else []
        if kinds and not any(isinstance(value, JSON_TYPES[k]) and not (k in ("integer", "number")
                                                                         and isinstance(value, bool))
                             for k in kinds if k in JSON_TYPES):
            return f"the argument {name!r} must be {' or '.join(kinds)}, not {type(value).__name__} {value!r}"[:300]
    return None


def counts(prefix):
    """Per episode since the last time: the calls, the errors (timeouts among them), the timeouts, and `called`, the
    share of episodes with a call that ran clean. ppo.py's tools/ of each update and eval/tools/ of each evaluation
    (each rank plays as many episodes, so the mean over ranks is the run's)."""
    episodes = max(COUNTS.pop("episodes", 0), 1)
    return {prefix + k: COUNTS.pop(k, 0) / episodes for k in ("calls", "errors", "timeouts", "called")}


def episodes(args, tokenizer, fail, score):
    """--tools' episodes, an --env class for ppo.py's `play`: the row's prompt; then each response's calls run and
    their results appended as tool messages (the template renders them; off the loss, in the critic's context), until
    a response calls nothing or --max-tool-calls calls have run; then `score(prompt, that response, columns)`. Bad
    input is `fail`'s one line. From here on the tokenizer renders every chat with the tools' schemas."""
    try:
        loaded = load(args.tools)
    except ValueError as e:
        fail(str(e))
    if "tools" not in (tokenizer.chat_template or ""):
        fail(f"--tools: the chat template of --model {args.model} never reads `tools`, so the model would "
                         "not see them: use a model whose template takes tools")
    schemas, limits = [t.schema for t in loaded], sandbox.Limits()
    tokenizer.apply_chat_template = functools.partial(tokenizer.apply_chat_template, tools=schemas)

    class Episode:
        def reset(self, row, seed):
            self.row, self.calls, self.clean = row, 0, 0
            COUNTS.update(episodes=1)
            return row["prompt"]

        def step(self, text):
            calls = parse(tokenizer, text, "", schemas, args.max_tool_calls - self.calls)
            if not calls or self.calls >= args.max_tool_calls:  # the answer
                COUNTS.update(called=int(self.clean > 0))
                columns = {k: [v] for k, v in self.row.items() if k not in ("prompt", args.prompt_column)}
                return None, score(self.row["prompt"], text, columns), True
            results = [run(loaded, c, limits) for c in calls]
            self.calls, self.clean = self.calls + len(calls), self.clean + sum(r.status == "ok" for r in results)
            COUNTS.update(calls=len(calls), errors=sum(r.status != "ok" for r in results),
                                  timeouts=sum(r.status == "timeout" for r in results))
            return [{"role": "tool", "name": c.name, "content": r.text} for c, r in zip(calls, results)], 0.0, False

    return Episode
