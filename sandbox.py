"""The sandbox for tool calls that run code (issue 64): each call in a fresh process, started clean, held to limits.

    result = sandbox.run("tools_file.py", "python", {"code": "print(2 ** 100)"})
    result.text, result.status   # what the model reads as the tool's result; "ok", "error", "timeout" or "limit"

A call runs in a new Python process (`python -I`: no environment variables inherited, no user site, not the
caller's folder on its path) in a fresh temporary folder that is removed after. The tool's file is imported first;
then, before the call, the process closes itself (every step below that this machine allows):

| limit | how | holds for a user other than root on Linux |
|---|---|---|
| wall clock (`wall_s`) | the caller kills the call's process group and pids cgroup | yes |
| CPU seconds (`cpu_s`) | RLIMIT_CPU | yes |
| memory (`memory_mb`) | RLIMIT_AS: an allocation past it raises MemoryError | yes |
| processes (`processes`) | a pids cgroup where /sys/fs/cgroup is writable; else RLIMIT_NPROC | yes (1) |
| output bytes (`output_bytes`) | the caller reads at most this many bytes, then kills the call | yes |
| file size (`file_mb`) | RLIMIT_FSIZE | yes |
| no network | a new network namespace (only a loopback, down); Landlock denies TCP | where (2); TCP: (3) |
| no files outside its folder | Landlock: reads only of Python's install and the system's libraries | yes (3) |
| no signals to other processes | Landlock's signal scope (its parent, the trainer, among them) | yes (3) |

(1) RLIMIT_NPROC in a new user namespace, which counts only the call's processes (kernel >= 5.14); root is exempt
from it, so as root only the cgroup caps processes. (2) Unprivileged user namespaces enabled (most distributions).
(3) Landlock in the kernel (`/sys/kernel/security/lsm` lists it): files from 5.13, TCP from 6.7, signals from 6.12.
`held()` says which of these hold on the machine it runs on, `can_hold()` which its kernel allows. A call that
breaks a limit, raises, times out, returns what JSON cannot hold or passes arguments of the wrong types returns an
error text for the model: the caller goes on.
"""
import ctypes
import dataclasses
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time


@dataclasses.dataclass
class Limits:
    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 1024
    processes: int = 16
    output_bytes: int = 16_384
    file_mb: int = 16


@dataclasses.dataclass
class Result:
    text: str  # what the model reads
    status: str  # "ok", "error" (the tool raised or was called wrongly), "timeout", "limit" (output, memory, ...)


# --- the caller's side ---------------------------------------------------------------------
def run(path, name, arguments, limits=Limits()):
    """Call `name` from the Python file `path` with `arguments` (a dict) in a process of its own, held to `limits`."""
    work = tempfile.mkdtemp(prefix="ppo-tool-")
    group = pids_cgroup(limits.processes)
    result_r, result_w = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), str(result_w)], cwd=work, env={},
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                pass_fds=(result_w,), start_new_session=True)
        os.close(result_w)
        if group:  # (before the request: the child reads it first, so it has started nothing yet)
            write(os.path.join(group, "cgroup.procs"), proc.pid)
        request = {"path": os.path.abspath(path), "name": name, "arguments": arguments,
                   "limits": dataclasses.asdict(limits)}
        proc.stdin.write(json.dumps(request).encode())
        proc.stdin.close()
        output, result = bytearray(), bytearray()
        readers = [threading.Thread(target=read_capped, args=(proc.stdout.fileno(), output, limits.output_bytes),
                                    daemon=True),
                   threading.Thread(target=read_capped, args=(result_r, result, limits.output_bytes), daemon=True)]
        for r in readers:
            r.start()
        deadline, status = time.monotonic() + limits.wall_s, None
        while proc.poll() is None:
            if time.monotonic() > deadline:
                status = "timeout"
                break
            if len(output) > limits.output_bytes or len(result) > limits.output_bytes:
                status = "output"
                break
            time.sleep(0.01)
        kill(proc, group)
        for r in readers:
            r.join(timeout=1)
    finally:
        os.close(result_r)
        shutil.rmtree(work, ignore_errors=True)
        if group:
            kill(None, group)
            try:
                os.rmdir(group)
            except OSError:
                pass
    printed = bytes(output[:limits.output_bytes]).decode(errors="replace")
    if status == "timeout":
        return Result(f"error: the call ran past its {limits.wall_s:g} s limit and was stopped", "timeout")
    if status == "output":
        return Result(f"error: the call printed more than {limits.output_bytes} bytes and was stopped", "limit")
    try:
        answer = json.loads(bytes(result).decode())
    except ValueError:
        how = (f"was killed by signal {-proc.returncode} ({signal.Signals(-proc.returncode).name})"
               if proc.returncode < 0 else f"exited with code {proc.returncode}")
        limit = " (its CPU-time limit)" if proc.returncode == -signal.SIGXCPU else ""
        return Result(f"error: the call {how}{limit}{': ' + printed[-500:] if printed else ''}",
                      "limit" if proc.returncode < 0 else "error")
    if "error" in answer:
        return Result(f"error: {answer['error']}", answer.get("status", "error"))
    return Result(printed if answer["result"] is None else json.dumps(answer["result"]), "ok")


def read_capped(fd, into, cap):
    """Read `fd` to its end, keeping at most cap + 1 bytes (one more tells the caller the cap was passed)."""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            return
        if not chunk:
            return
        into.extend(chunk[:max(0, cap + 1 - len(into))])


def kill(proc, group):
    """SIGKILL the call's process group and every process in its pids cgroup (a child that left the group)."""
    if proc is not None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
    for _ in range(100) if group else ():
        pids = open(os.path.join(group, "cgroup.procs")).read().split()
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.01)


def pids_cgroup(processes):
    """A fresh pids cgroup capped at `processes`, where this process may make one (root, cgroup v1 or v2); else
    None (RLIMIT_NPROC in the child's user namespace is the cap then)."""
    controllers = "/sys/fs/cgroup/cgroup.controllers"  # (cgroup v2; v1 has a pids folder)
    v2 = os.path.exists(controllers) and "pids" in open(controllers).read()
    base = "/sys/fs/cgroup/pids" if os.path.isdir("/sys/fs/cgroup/pids") else "/sys/fs/cgroup" if v2 else None
    if base and os.access(base, os.W_OK):
        path = os.path.join(base, f"ppo-tool-{os.getpid()}-{time.monotonic_ns()}")
        try:
            os.mkdir(path)
            write(os.path.join(path, "pids.max"), processes)
            return path
        except OSError:
            shutil.rmtree(path, ignore_errors=True)
    return None


def write(path, value):
    with open(path, "w") as f:
        f.write(str(value))


# --- the call's side -----------------------------------------------------------------------
LANDLOCK_CREATE, LANDLOCK_ADD, LANDLOCK_RESTRICT = 444, 445, 446  # syscall numbers, the same on every architecture
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1, 2, 4, 8


def landlock_abi():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return max(0, libc.syscall(LANDLOCK_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1)))


def close_in(work, limits):
    """Everything the call may not do, closed in this process before the call (see the table above). Returns the
    steps that held."""
    held = []
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_mb"] << 20,) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_mb"] << 20,) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    if libc.unshare(0x10000000 | 0x40000000) == 0:  # CLONE_NEWUSER | CLONE_NEWNET: no network, and a namespace in
        held.append("network namespace")  # which RLIMIT_NPROC counts only this call's processes
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"],) * 2)  # (root is exempt: the cgroup is its cap)
    abi = landlock_abi()
    if abi >= 1:
        fs = (1 << 13) - 1 | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0) | (1 << 15 if abi >= 5 else 0)
        attr = (ctypes.c_uint64 * 3)(fs, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)  # fs; TCP bind, connect; scopes
        size = 8 * (1 + (abi >= 4) + (abi >= 6))
        ruleset = libc.syscall(LANDLOCK_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
        readable = {sys.base_prefix, *(p for p in sys.path if os.path.isdir(p)), "/usr/lib", "/usr/lib64", "/lib",
                    "/lib64", "/usr/local/lib", "/etc/ld.so.cache", "/dev/urandom"}
        rules = [(p, EXECUTE | READ_FILE | (READ_DIR if os.path.isdir(p) else 0)) for p in readable if
                 os.path.exists(p)] + [(work, fs), ("/dev/null", READ_FILE | WRITE_FILE)]
        for path, access in rules:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            rule = PathBeneath(access & fs, fd)
            libc.syscall(LANDLOCK_ADD, ctypes.c_int(ruleset), ctypes.c_int(1), ctypes.byref(rule), ctypes.c_uint32(0))
            os.close(fd)
        libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS, which Landlock asks of a process without CAP_SYS_ADMIN
        if ruleset >= 0 and libc.syscall(LANDLOCK_RESTRICT, ctypes.c_int(ruleset), ctypes.c_uint32(0)) == 0:
            held += ["files"] + (["tcp"] if abi >= 4 else []) + (["signals"] if abi >= 6 else [])
    return held


class PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def child(result_fd):
    """The call's process: read the request, import the tool's file, close in, call, answer on `result_fd`."""
    request = json.loads(sys.stdin.read())
    out = os.fdopen(result_fd, "w")
    try:
        import importlib.util
        spec = importlib.util.spec_from_file_location("tools_file", request["path"])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        fn = getattr(module, request["name"])
    except Exception as e:  # (the caller loaded this file already: this is not expected)
        out.write(json.dumps({"error": f"the tool could not be loaded: {type(e).__name__}: {e}"}))
        return
    HELD.extend(close_in(os.getcwd(), request["limits"]))
    try:
        value = fn(**request["arguments"])
    except MemoryError:
        answer = {"error": f"the call ran out of its {request['limits']['memory_mb']} MB of memory", "status": "limit"}
    except BaseException as e:  # noqa: BLE001  (whatever the call raised is the model's to read)
        answer = {"error": f"{type(e).__name__}: {e}"}
    else:
        try:
            answer = {"result": value if value is None else json.loads(json.dumps(value, allow_nan=False))}
        except (TypeError, ValueError) as e:
            answer = {"error": f"the tool returned what JSON cannot hold ({type(value).__name__}: {e})"}
    sys.stdout.flush()
    out.write(json.dumps(answer))
    out.flush()


HELD = []  # (in a call's process: the steps of close_in that held)


def held():
    """The steps of close_in that hold on this machine (read by a call), and "processes" where a cap on them holds:
    a pids cgroup, or RLIMIT_NPROC for a user other than root in a new user namespace."""
    steps = set(json.loads(run(__file__, "_held", {}).text))
    return steps | ({"processes"} if process_cap("network namespace" in steps) else set())


def can_hold():
    """What this machine lets a process close, asked of the kernel directly (not through close_in): Landlock's ABI,
    a new user and network namespace, and a cap on processes (a pids cgroup, or a user other than root)."""
    abi = landlock_abi()
    namespaces = subprocess.run([sys.executable, "-I", "-c", "import ctypes, sys\n"
                                 "sys.exit(ctypes.CDLL(None).unshare(0x10000000 | 0x40000000) != 0)"]).returncode == 0
    return {step for step, ok in (("files", abi >= 1), ("tcp", abi >= 4), ("signals", abi >= 6),
                                  ("network namespace", namespaces), ("processes", process_cap(namespaces))) if ok}


def process_cap(namespaces):
    """Whether a call's processes are capped: a pids cgroup this process may make, or RLIMIT_NPROC, which holds in a
    new user namespace for a user other than root."""
    cgroup = pids_cgroup(1)
    if cgroup:
        os.rmdir(cgroup)
    return bool(cgroup) or os.geteuid() != 0 and namespaces


def _held():
    return sys.modules["__main__"].HELD  # (the call's own module: this file, loaded again as the tools file, is not)


def python(code: str):
    """Run Python code and return what it printed.

    Args:
        code: the program; print what you want to see.
    """
    exec(compile(code, "<tool call>", "exec"), {"__name__": "__main__"})


if __name__ == "__main__":
    child(int(sys.argv[1]))
