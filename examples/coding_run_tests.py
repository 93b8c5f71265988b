# Trusted runner (loopline's verifier contract): the hidden tests run HERE, and the agent's solution.py
# runs only in a child started through $LOOPLINE_AGENT_EXEC (as the agent: it cannot read this directory
# or write the verdict). The tests call the solution's functions through proxies: arguments go to the
# child as Python literals, and only literals come back (ast.literal_eval), so nothing the solution
# does -- printing, exiting, patching modules, objects that equal everything -- reaches this process.
import ast, builtins, json, os, re, select, signal, subprocess, sys, time, types

CHILD = r"""
import ast, os, sys
requests, replies = os.fdopen(os.dup(0), "r"), os.fdopen(os.dup(1), "w")
quiet = os.open(os.devnull, os.O_RDWR)
os.dup2(quiet, 0); os.dup2(quiet, 1)
sys.path.insert(0, os.getcwd())
try:
    import solution
    problem = None
except BaseException as exc:
    problem = type(exc).__name__
for line in requests:
    name, args, kwargs = ast.literal_eval(line)
    try:
        if problem:
            raise ImportError(problem)
        reply = ("ok", repr(getattr(solution, name)(*args, **kwargs)))
    except BaseException as exc:
        reply = ("raise", type(exc).__name__)
    replies.write(repr(reply) + "\n")
    replies.flush()
"""


class Solution:
    """The agent's solution in a child process; every call has a deadline and returns plain data."""

    def __init__(self):
        self.proc, self.buffer = None, b""

    def start(self):
        argv = json.loads(os.environ["LOOPLINE_AGENT_EXEC"]) + ["python3", "-c", CHILD]
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ["LOOPLINE_WORKDIR"], "LANG": "C.UTF-8"}
        self.proc = subprocess.Popen(argv, cwd=os.environ["LOOPLINE_WORKDIR"], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
        self.buffer = b""

    def stop(self):
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            self.proc.wait()
            self.proc = None

    def call(self, name, args, kwargs, deadline):
        if self.proc is None:
            self.start()
        try:
            self.proc.stdin.write((repr((name, args, kwargs)) + "\n").encode())
            self.proc.stdin.flush()
            line = self._line(deadline)
            kind, value = ast.literal_eval(line.decode())
            if kind == "ok":
                return ast.literal_eval(value)
        except (OSError, ValueError, SyntaxError, TypeError, MemoryError, RecursionError, TimeoutError):
            self.stop()  # a hung, dead or garbled solution fails this test; the next test starts afresh
            raise AssertionError("no usable answer from the solution")
        error = getattr(builtins, value, None)
        raise error() if isinstance(error, type) and issubclass(error, Exception) else RuntimeError(value)

    def _line(self, deadline):
        out = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([out], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(out, 1 << 16)
            if not chunk or len(self.buffer) > 1 << 20:
                raise OSError("solution process ended or answered too much")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line


solution, deadline = Solution(), [0.0]


class Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: solution.call(name, args, kwargs, deadline[0])


sys.modules["solution"] = Module("solution")
source = open("tests.py").read()
total = len(re.findall(r"^def test_", source, re.M))
passed = 0
namespace = {}
exec(compile(source, "tests.py", "exec"), namespace)
for name, test in list(namespace.items()):
    if name.startswith("test_") and callable(test):
        deadline[0] = time.monotonic() + 5
        try:
            test()
            passed += 1
        except Exception:
            pass
solution.stop()
with open(os.environ["LOOPLINE_VERDICT_FILE"], "w") as verdict:
    json.dump({"passed": passed, "total": total}, verdict)
