"""Both sides of `CodeGrader`'s test runs: the program that serves the solution's names, and the
checker that runs the tests against them from another process of the sandbox.

The tests never run in the solution's interpreter: it cannot read them, the expected values or
the verdict, nor change how they compare. The checker (trusted, not dumpable, another uid) runs
the tests with each of the solution's top-level names bound to what the solution gives: plain
data by value, anything else (functions, classes, instances) as a `Remote` the checker may call,
read attributes and items of, iterate, take ``len``, ``bool`` and ``str`` of; every answer comes
back as plain data or another `Remote`. Comparisons happen in the checker, between plain values
only: a `Remote` refuses ``==`` and ``!=``, so an object of the solution whose ``__eq__`` always
answers True passes nothing. Plain data is ``None``, bool, int, float, complex, str, bytes and
lists, tuples, dicts, sets and frozensets of them, of exactly those types (a subclass of ``int``
is not plain), sent as JSON lines (`encode`, `decode`) over two pipes: the program reads requests
on fd 3 and answers on fd 4, the checker the other way round.

The sandbox runs this file's source, not this module: the program's ``main.py`` is the part above
the checker's side followed by ``serve("solution.py")``, the checker's the parts without the
program's side followed by ``check(<tests>)`` (`areal_lite.rewards.code` cuts them at the ``# ----``
lines); inside, only the standard library is there. Importing it (tests) runs neither.
"""

from __future__ import annotations

import builtins
import json
import sys

TYPE_CHECKING = False  # typing's flag, without importing typing: each sandboxed run pays for imports
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

NOT_PLAIN = "the solution gave an object, not plain data: compare plain values (lists, numbers, strings ...)"


def encode(value: Any, ref: Callable[[Any], dict]) -> Any:
    """``value`` as JSON-able data: plain data by value, anything else as ``ref(value)``."""
    kind = type(value)
    if value is None or kind is bool or kind is str or kind is float:
        return value
    if kind is int:
        return value if -(1 << 53) < value < 1 << 53 else {"int": hex(value)}  # no decimal digit limit
    if kind is list:
        return [encode(v, ref) for v in value]
    if kind in (tuple, set, frozenset):
        return {kind.__name__: [encode(v, ref) for v in value]}
    if kind is dict:
        return {"dict": [[encode(k, ref), encode(v, ref)] for k, v in value.items()]}
    if kind is bytes:
        return {"bytes": value.hex()}
    if kind is complex:
        return {"complex": [value.real, value.imag]}
    return ref(value)


def decode(data: Any, remote: Callable[[int], Any]) -> Any:
    """The value `encode` wrote; ``{"ref": n}`` becomes ``remote(n)``."""
    if isinstance(data, list):
        return [decode(v, remote) for v in data]
    if not isinstance(data, dict):
        return data  # None, bool, int, float, str: what json.loads makes
    ((tag, body),) = data.items()
    if tag == "ref":
        return remote(int(body))
    if tag == "int":
        return int(body, 16)
    if tag == "bytes":
        return bytes.fromhex(body)
    if tag == "complex":
        return complex(*body)
    if tag == "dict":
        return {decode(k, remote): decode(v, remote) for k, v in body}
    if tag in ("tuple", "set", "frozenset"):
        return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](decode(v, remote) for v in body)
    raise ValueError(f"not plain data: {tag!r}")


class _Pipe:
    """JSON lines in on one fd, out on another."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self.reader = open(read_fd, "rb")  # noqa: SIM115 - open as long as the process
        self.writer = open(write_fd, "wb")  # noqa: SIM115

    def send(self, message: object) -> None:
        self.writer.write(json.dumps(message).encode() + b"\n")
        self.writer.flush()

    def receive(self) -> Any:
        line = self.reader.readline()
        return json.loads(line) if line else None


# ---- the program's side: runs in the solution's interpreter -----------------------------------


def serve(solution_path: str, read_fd: int = 3, write_fd: int = 4) -> None:
    """Run the solution as a module named ``solution`` (a block under ``if __name__ ==
    "__main__"`` does not run, as when tests import it), then answer the checker's requests until
    it hangs up."""
    pipe = _Pipe(read_fd, write_fd)
    scope: dict[str, Any] = {"__name__": "solution"}
    with open(solution_path) as f:
        source = f.read()
    exec(compile(source, "solution.py", "exec"), scope)  # noqa: S102 - the program is the solution
    objects: list[Any] = [scope]
    refs: dict[int, int] = {}

    def ref(value: Any) -> dict:
        if id(value) not in refs:
            refs[id(value)] = len(objects)
            objects.append(value)  # kept alive: its id stays its own
        return {"ref": refs[id(value)]}

    while (request := pipe.receive()) is not None:
        try:
            answer = {"value": encode(_answer(request, objects, scope), ref)}
        except BaseException as e:  # noqa: BLE001 - every failure of the solution goes to the checker
            answer = {"raise": [type(e).__name__, str(e)[:2000]]}
        pipe.send(answer)


def _answer(request: dict, objects: list[Any], scope: dict[str, Any]) -> Any:
    op = request["op"]
    if op == "globals":
        return {
            name: value
            for name, value in scope.items()
            if not name.startswith("__") and not isinstance(value, type(sys))  # not modules
        }
    target = objects[request["ref"]]
    args = decode(request.get("args", []), objects.__getitem__)
    if op == "get":
        return scope[request["name"]] if target is scope else getattr(target, request["name"])
    if op == "call":
        return target(*args, **dict(decode(request["kwargs"], objects.__getitem__)))
    if op == "item":
        return target[args[0]]
    unary: dict[str, Callable[[Any], Any]] = {"bool": bool, "len": len, "list": list, "str": str}
    return unary[op](target)


# ---- the checker's side: runs the tests, in a process the solution cannot inspect --------------


class SolutionError(Exception):
    """The solution raised an exception that is not one of Python's built-in ones."""


class SolutionGone(Exception):
    """The program ended (or broke the protocol) before answering: its stderr says why."""


class Remote:
    """An object of the solution, used from the checker: every use is a request to the program."""

    __slots__ = ("_link", "_ref")

    def __init__(self, ref: int, link: _Link) -> None:
        object.__setattr__(self, "_ref", ref)
        object.__setattr__(self, "_link", link)

    def _ask(self, op: str, **fields: Any) -> Any:
        return self._link.ask({"op": op, "ref": self._ref, **fields})

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        encoded = [[k, self._link.encode(v)] for k, v in kwargs.items()]
        return self._ask("call", args=self._link.encode(list(args)), kwargs=encoded)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)  # Python's own look-ups (copy, pickle ...) stay here
        return self._ask("get", name=name)

    def __getitem__(self, key: Any) -> Any:
        return self._ask("item", args=self._link.encode([key]))

    def __bool__(self) -> bool:
        return self._plain("bool", bool)

    def __len__(self) -> int:
        return self._plain("len", int)

    def __iter__(self) -> Any:
        return iter(self._plain("list", list))

    def __str__(self) -> str:
        return self._plain("str", str)

    def __repr__(self) -> str:
        return f"<object #{self._ref} of the solution>"

    def __eq__(self, other: object) -> bool:
        raise TypeError(NOT_PLAIN)

    def __ne__(self, other: object) -> bool:
        raise TypeError(NOT_PLAIN)

    __hash__ = object.__hash__  # identity: the same object of the solution is the same Remote

    def _plain(self, op: str, kind: type) -> Any:
        value = self._ask(op)
        if type(value) is not kind:
            raise TypeError(f"{op}() of an object of the solution gave {type(value).__name__}, not {kind.__name__}")
        return value


class _Link:
    """The checker's end of the pipes: requests out, answers decoded, the solution's exceptions raised."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self.pipe = _Pipe(read_fd, write_fd)
        self.remotes: dict[int, Remote] = {}

    def remote(self, ref: int) -> Remote:
        return self.remotes.setdefault(ref, Remote(ref, self))

    def encode(self, value: Any) -> Any:
        return encode(value, self._ref)

    @staticmethod
    def _ref(value: Any) -> dict:
        if isinstance(value, Remote):
            return {"ref": value._ref}
        raise TypeError(f"the tests passed a {type(value).__name__} to the solution: only plain data can go there")

    def ask(self, request: dict) -> Any:
        try:
            self.pipe.send(request)
        except BrokenPipeError:
            raise SolutionGone("the program ended before answering") from None
        answer = self.pipe.receive()
        if not isinstance(answer, dict) or len(answer) != 1:
            raise SolutionGone(
                "the program ended before answering" if answer is None else "the program broke the protocol"
            )
        if "raise" in answer:
            name, message = (str(part) for part in answer["raise"])
            error = getattr(builtins, name, None)
            if isinstance(error, type) and issubclass(error, Exception):
                raise error(message)  # the tests may expect ValueError and the like
            raise SolutionError(f"{name}: {message}")
        return decode(answer["value"], self.remote)


def check(tests: str, read_fd: int = 3, write_fd: int = 4) -> None:
    """Run ``tests`` with the solution's names bound (plain values, or `Remote` objects); any
    exception (a failed assert, a non-plain comparison, the program gone) fails the check."""
    link = _Link(read_fd, write_fd)
    names = link.ask({"op": "globals"})
    if not isinstance(names, dict) or not all(isinstance(k, str) for k in names):
        raise SolutionGone("the program broke the protocol")
    scope = {"__name__": "__main__", **names}
    exec(compile(tests, "tests.py", "exec"), scope)  # noqa: S102 - the tests are the grader's own
    sys.stdout.flush()
