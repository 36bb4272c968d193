"""Rollout workflows in a child process (``rollout.episode_process=true``).

A `WorkflowExecutor` normally runs workflows on a thread of the trainer's process. Their Python
work (HTTP and JSON, detokenization, rewards, building the trajectory TensorDicts) then competes
with training for the trainer's interpreter lock: in asynchronous RL, where rollouts run while the
trainer trains, a training step slows by about the rollout client's CPU time per step (measured on
the quickstart, benchmarks/async_vs_sync.py). An `EpisodeWorker` moves that work to a child
process with its own HTTP client of the rollout servers; the executor keeps the bookkeeping (the
staleness bound, the dataloader, recovery state) and only sends each episode's input there and
gets its trajectory back over a pipe. The child builds its own engine with the factory it is given
(e.g. a `RemoteSGLangEngine` that generates on the servers but leaves controlling them to the
trainer's client: ``control_servers=False``).

Protocol (pickled tuples over one `multiprocessing` pipe; the child answers each request by its
number; trajectories travel as numpy arrays, which pickle ~20x faster than tensors):

    parent -> child   ("workflow", key, pickled workflow)    once per workflow object
                      ("episode", seq, key, data)            run workflow ``key`` on ``data``
                      ("cancel", seq)                        the executor gave the episode up
                      ("control", seq, name, arg)            pause / resume / version; acknowledged
    child -> parent   ("done", seq, packed TensorDict | None)
                      ("error", seq, exception)              the workflow raised
                      ("ack", seq)

Pauses: the `RolloutController` pauses the child's engine before the trainer's engine pauses the
servers for a weight update, so generations the pause aborts wait for the resume instead of
queueing on the paused servers, exactly as in-process ones do; versions are forwarded the same way. A dead child fails every episode
in flight and every later one with a `RuntimeError` (the executor reports it as a workflow error);
the child exits when the pipe closes, so a killed trainer leaves no orphan.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import pickle
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np
import torch
from tensordict import TensorDict

from areal_lite.api.config import InferenceEngineConfig
from areal_lite.api.engine import InferenceEngine
from areal_lite.api.workflow import RolloutWorkflow
from areal_lite.cpu import freeze_startup_objects, rollout_client_thread

logger = logging.getLogger(__name__)

START_TIMEOUT = 120.0
"""Seconds the child may take to import the framework and start its client."""

EngineFactory = Callable[[], InferenceEngine]
"""Builds the child's (uninitialised) engine; it is pickled to the child, so a class or a
`functools.partial` of one, not a lambda."""


class EpisodeWorker:
    """The parent's handle on the child process that runs rollout workflows."""

    def __init__(self, config: InferenceEngineConfig, engine_factory: EngineFactory) -> None:
        self._seq = itertools.count()
        self._lock = threading.Lock()  # guards the pipe's send end and the tables below
        self._waiting: dict[int, Future] = {}
        self._workflows: dict[int, RolloutWorkflow] = {}
        """Workflows sent to the child, by id (held, so that no id is reused for another one)."""
        self._dead: str | None = None
        ctx = multiprocessing.get_context("spawn")  # a fork would copy the trainer's threads' locks
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(
            target=_child_main, args=(config, engine_factory, child_conn), name="episode-worker", daemon=True
        )
        self._proc.start()
        child_conn.close()
        self._reader = threading.Thread(target=self._read, name="episode-worker-reader", daemon=True)
        self._reader.start()
        self.control("ping", None).result(timeout=START_TIMEOUT)

    # ----------------------------------------------------------------- parent side

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    async def run_episode(self, workflow: RolloutWorkflow, data: dict[str, object]) -> TensorDict | None:
        """``workflow.arun_episode(engine, data)``, run in the child."""
        key = id(workflow)
        with self._lock:
            if key not in self._workflows:
                try:
                    blob = pickle.dumps(workflow)
                except Exception as e:
                    raise TypeError(
                        f"rollout.episode_process=true sends workflows to a child process, and "
                        f"{type(workflow).__name__} does not pickle: {type(e).__name__}: {e}"
                    ) from e
                self._send(("workflow", key, blob))
                self._workflows[key] = workflow
        seq, future = self._request("episode", key, data)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # wrap_future has cancelled ``future`` already: whether the child still owes an
            # answer is whether ``seq`` still waits
            with self._lock:
                if self._waiting.pop(seq, None) is not None and self._dead is None:
                    with contextlib.suppress(RuntimeError):  # the child is gone: nothing to cancel
                        self._send(("cancel", seq))
            raise

    def control(self, name: str, arg: object) -> Future:
        """Send a control message; the future completes when the child has applied it."""
        return self._request("control", name, arg)[1]

    def close(self) -> None:
        """Stop the child and fail whatever still waits. The child is told to stop: closing the
        pipe alone would not reach it while this process's reader is blocked on the pipe (the
        socket stays open until that read returns), and the child would be killed after 10 s."""
        with self._lock:
            if self._dead is None:
                with contextlib.suppress(RuntimeError):  # the child is gone already
                    self._send(("stop",))
            self._dead = self._dead or "the episode worker was closed"
            self._conn.close()
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._reader.join(timeout=10)

    def _request(self, kind: str, *args: object) -> tuple[int, Future]:
        future: Future = Future()
        with self._lock:
            seq = next(self._seq)
            self._send((kind, seq, *args))
            self._waiting[seq] = future
        return seq, future

    def _send(self, message: tuple) -> None:
        """Send under ``self._lock``; a broken pipe means the child died (the reader reports it)."""
        if self._dead is not None:
            raise RuntimeError(self._dead)
        try:
            self._conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        except (OSError, ValueError) as e:
            raise RuntimeError(f"the episode worker process is gone ({type(e).__name__}: {e})") from e

    def _read(self) -> None:
        """Complete the futures of the child's answers; on EOF, fail every one still waiting."""
        while True:
            try:
                kind, seq, *rest = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError, TypeError):  # TypeError: close() closed the pipe under us
                break
            with self._lock:
                future = self._waiting.pop(seq, None)
            if future is None or not future.set_running_or_notify_cancel():  # cancelled meanwhile
                continue
            if kind == "error":
                future.set_exception(rest[0])
            elif kind == "done":
                future.set_result(_unpack(rest[0]))
            else:
                future.set_result(None)
        self._proc.join(timeout=5)
        with self._lock:
            if self._dead is None:
                self._dead = f"the episode worker process died (exit code {self._proc.exitcode})"
                logger.error("%s", self._dead)
            waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError(self._dead))


# --------------------------------------------------------------------- child side


def _child_main(
    config: InferenceEngineConfig, engine_factory: EngineFactory, conn: multiprocessing.connection.Connection
) -> None:
    rollout_client_thread(config.client_cores)  # before any thread starts: they inherit it
    engine = engine_factory()
    engine.initialize()
    freeze_startup_objects()
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    workflows: dict[int, RolloutWorkflow] = {}
    tasks: dict[int, asyncio.Task] = {}

    def send(message: tuple) -> None:
        blob = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)  # raises before writing anything
        try:
            conn.send_bytes(blob)
        except (OSError, ValueError):  # the parent is gone: the reader sees EOF and stops the loop
            pass

    async def episode(seq: int, key: int, data: dict[str, object]) -> None:
        try:
            traj = await workflows[key].arun_episode(engine, data)
            send(("done", seq, _pack(traj)))
        except asyncio.CancelledError:
            pass
        except Exception as e:  # noqa: BLE001 - the parent reports it with the episode's input
            send(("error", seq, _picklable(e)))
        finally:
            tasks.pop(seq, None)

    def control(seq: int, name: str, arg: object) -> None:
        if name == "pause":
            engine.pause()
        elif name == "resume":
            engine.resume()
        elif name == "version":
            engine.set_version(int(arg))  # type: ignore[arg-type]
        elif name != "ping":
            send(("error", seq, ValueError(f"unknown control message {name!r}")))
            return
        send(("ack", seq))

    def handle(blob: bytes) -> None:
        kind, *args = pickle.loads(blob)
        if kind == "workflow":
            workflows[args[0]] = pickle.loads(args[1])
        elif kind == "episode":
            tasks[args[0]] = loop.create_task(episode(*args))
        elif kind == "cancel":
            task = tasks.pop(args[0], None)
            if task is not None:
                task.cancel()
        elif kind == "control":
            control(*args)
        elif kind == "stop":
            loop.stop()

    def read() -> None:
        while True:
            try:
                blob = conn.recv_bytes()
            except (EOFError, OSError):
                break
            loop.call_soon_threadsafe(handle, blob)
        loop.call_soon_threadsafe(loop.stop)

    threading.Thread(target=read, name="episode-worker-pipe", daemon=True).start()
    try:
        loop.run_forever()
    finally:
        for task in list(tasks.values()):
            task.cancel()
        engine.destroy()


def _pack(traj: object) -> object:
    """A trajectory for the pipe: a flat TensorDict of CPU tensors as numpy arrays (anything else,
    e.g. nested or bfloat16 entries, as itself)."""
    if isinstance(traj, TensorDict) and all(
        isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.dtype != torch.bfloat16 for v in traj.values()
    ):
        return ("numpy", tuple(traj.batch_size), {k: v.detach().numpy() for k, v in traj.items()})
    return ("object", traj)


def _unpack(packed: tuple) -> object:
    if packed[0] == "numpy":
        _, batch_size, arrays = packed
        return TensorDict({k: torch.from_numpy(np.asarray(a)) for k, a in arrays.items()}, batch_size=batch_size)
    return packed[1]


def _picklable(error: BaseException) -> BaseException:
    """``error`` itself if it pickles, else a RuntimeError carrying its type, message and traceback."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001
        text = "".join(traceback.format_exception(error))
        return RuntimeError(f"{type(error).__name__}: {error}\n{text}")
