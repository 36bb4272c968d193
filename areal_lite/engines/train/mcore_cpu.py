"""Run megatron-core on CPU (gloo): the one place that papers over its hard-coded CUDA calls.

megatron-core 0.16 assumes a GPU in a few spots that our configuration reaches: tensors created
with ``device="cuda"`` (optimizer flags, gradient-norm buffers, the schedule's token counter),
``torch.cuda.current_device()`` as a device argument (buffers, rotary embeddings, all-gathers)
and the CUDA RNG behind its tensor-parallel RNG tracker. Without CUDA every one of those calls
raises, so mapping them to the CPU changes nothing that could otherwise run:

- `cpu_compat` is a context manager that, only when CUDA is unavailable, redirects CUDA device
  arguments and ``Tensor.cuda()`` to the CPU, reports CPU tensors' ``Tensor.type()`` as the CUDA
  type name the optimizer's dtype checks expect (a `TorchFunctionMode`), makes
  ``torch.cuda.current_device()`` return the CPU device and ``torch.cuda.synchronize()`` (called
  after pipeline sends) do nothing. `MegatronEngine` enters it around every
  call into megatron-core; with CUDA it is a no-op.
- `install_cpu_rng_tracker` replaces megatron's CUDA RNG tracker by one that forks the CPU
  generator, and its CUDA RNG state getter/setter by the CPU ones, so dropout inside
  tensor-parallel regions and activation recomputation (which replays RNG states) work.

Mixture-of-experts layers (expert parallelism over gloo, measured to run forward and backward with
the all-to-all token dispatcher, which also takes different token counts on different ranks): the
dispatcher copies split sizes to the host on a side CUDA stream, so `cpu_compat` also stands in for
CUDA streams and events (work on the CPU is already ordered), and `install_moe_fallbacks` makes its
host copy of split sizes, which skips tensors already on the CPU, still turn them into the numpy
arrays that ``all_to_all_single`` takes. Without Transformer Engine (on GPUs too), megatron-core
0.16's router refers to a ``te_general_gemm`` it never defines; `install_moe_fallbacks` defines it
as absent, which selects the router's plain matmul.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode


def cpu_mode() -> bool:
    """True when megatron-core has to be run on the CPU (no CUDA device)."""
    return not torch.cuda.is_available()


def _is_cuda(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU for every torch call made inside it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # dtype checks compare against "torch.cuda.FloatTensor" and friends
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


class _HostStream:
    """A stand-in for a CUDA stream (and its events) on the CPU, where work is already in order."""

    def wait_stream(self, stream: object) -> None:
        pass

    def record_event(self, event: object = None) -> _HostStream:
        return self

    def synchronize(self) -> None:
        pass


_HOST_STREAM = _HostStream()


@contextlib.contextmanager
def cpu_compat() -> Iterator[None]:
    """Inside this context megatron-core's CUDA-only calls run on the CPU (no-op with CUDA)."""
    if not cpu_mode():
        yield
        return
    cuda = torch.cuda
    saved = cuda.current_device, cuda.synchronize, cuda.Stream, cuda.current_stream, cuda.stream
    cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    cuda.Stream = lambda *args, **kwargs: _HOST_STREAM  # type: ignore[assignment]
    cuda.current_stream = lambda device=None: _HOST_STREAM  # type: ignore[assignment]
    cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]
    try:
        with _CudaToCpu():
            yield
    finally:
        cuda.current_device, cuda.synchronize, cuda.Stream, cuda.current_stream, cuda.stream = saved  # type: ignore[assignment]


def install_moe_fallbacks() -> None:
    """Let megatron-core's MoE layers run without Transformer Engine and, in `cpu_mode`, without
    CUDA (see the module docstring). Idempotent."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    host_copy = token_dispatcher.maybe_move_tensor_to_cpu
    if not cpu_mode() or getattr(host_copy, "_areal_cpu", False):
        return

    def to_host(tensor: object, as_numpy: bool = False, record_stream: bool = False) -> object:
        if as_numpy and isinstance(tensor, torch.Tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return host_copy(tensor, as_numpy=as_numpy, record_stream=record_stream)

    to_host._areal_cpu = True  # type: ignore[attr-defined]
    token_dispatcher.maybe_move_tensor_to_cpu = to_host


def install_cpu_rng_tracker(seed: int) -> None:
    """Seed megatron's RNG tracker (`model_parallel_cuda_manual_seed`) on the CPU generator.
    Call only in `cpu_mode`; it replaces megatron's CUDA RNG functions for the whole process."""
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """megatron's tracker with named states of the CPU generator instead of CUDA ones."""

        def add(self, name: str, seed: int) -> None:
            if name in self.states_:
                raise RuntimeError(f"rng state {name} already exists")
            self._is_initialized = True
            gen = torch.Generator()
            gen.manual_seed(seed)
            self.states_[name] = gen.get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise RuntimeError(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    with cpu_compat():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
