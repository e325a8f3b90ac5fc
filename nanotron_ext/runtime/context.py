"""A Nanotron ``ParallelContext`` that runs on CPU over gloo.

Nanotron 0.2's ``ParallelContext.__init__`` calls ``torch.cuda.set_device`` and asserts the NCCL backend, so
it cannot be constructed on a machine without a GPU. The process-group layout itself
(``_init_parallel_groups``) is backend-agnostic, so this subclass sets the same attributes, brings up gloo
itself and then reuses Nanotron's layout code unchanged: ``tp_pg``, ``dp_pg``, ``pp_pg``, ``expert_pg``,
``mp_pg``, ``world_rank_matrix`` and ``world_ranks_to_pg`` are exactly what Nanotron would build on GPUs.
Under ``NANOTRON_EXT_DEVICE=cuda`` it also selects each rank's GPU; the groups stay gloo
(:mod:`nanotron_ext.runtime.device`).
"""

from __future__ import annotations

import datetime
import inspect
import os
import re
from types import TracebackType

import numpy as np
import torch
import torch.distributed as torch_dist
from nanotron import distributed as dist
from nanotron.parallel.context import ParallelContext

from nanotron_ext.allocator import keep_freed_memory
from nanotron_ext.errors import ConfigError, NanotronExtError, RunFailure
from nanotron_ext.procs import RENDEZVOUS_VARIABLES
from nanotron_ext.runtime.device import device_from_env

__all__ = ["DEFAULT_TIMEOUT_S", "TIMEOUT_ENV", "GlooParallelContext", "comm_failure", "timeout_from_env"]

# Nanotron's groups default to a 10 minute timeout; a CPU test that deadlocks should fail much sooner.
DEFAULT_TIMEOUT_S = 60.0
#: Environment variable that overrides DEFAULT_TIMEOUT_S for ``nanotron-ext train`` (seconds, > 0).
TIMEOUT_ENV = "NANOTRON_EXT_TIMEOUT_S"


def timeout_from_env() -> float:
    """The process-group timeout: ``$NANOTRON_EXT_TIMEOUT_S`` when set, else :data:`DEFAULT_TIMEOUT_S`.

    How long a rank waits for a peer that stopped answering before it fails with a message naming that peer.

    Raises:
        ConfigError: the variable is not a positive number of seconds.
    """
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value < float("inf")):
        raise ConfigError(f"{TIMEOUT_ENV}={raw!r} must be a positive number of seconds, e.g. {TIMEOUT_ENV}=60")
    return value


#: Upstream main's ParallelContext takes a context-parallel size (0.2's does not).
_UPSTREAM_SIGNATURE = "context_parallel_size" in inspect.signature(ParallelContext.__init__).parameters


class GlooParallelContext(ParallelContext):
    """Nanotron ``ParallelContext`` over gloo on CPU, with the same process-group layout as Nanotron's.

    Use it as a context manager: ``with GlooParallelContext(1, 2, 1) as ctx: ...`` tears the groups down on the
    way out, after a barrier when the block ended normally and without one when it raised (a barrier would
    wait for a peer that may be dead or stuck, until gloo's timeout).

    Args:
        tensor_parallel_size: TP degree.
        pipeline_parallel_size: PP degree.
        data_parallel_size: DP degree.
        expert_parallel_size: expert-parallel degree (1 unless you know you need it).
        timeout_s: timeout of every process group created here, so that a deadlocked collective raises
            instead of hanging for Nanotron's default 10 minutes.

    Raises:
        ValueError: a size is not a positive integer, the torchrun environment variables are missing, or
            ``WORLD_SIZE`` differs from ``tp * pp * dp * ep``.
        RuntimeError: a default process group already exists with a backend other than gloo.
    """

    def __init__(
        self,
        tensor_parallel_size: int,
        pipeline_parallel_size: int,
        data_parallel_size: int,
        expert_parallel_size: int = 1,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        # Deliberately no super().__init__(): it calls torch.cuda.set_device and asserts NCCL.
        world_size = _check_world(
            tensor_parallel_size, pipeline_parallel_size, data_parallel_size, expert_parallel_size
        )
        self.tensor_parallel_size = int(tensor_parallel_size)
        self.pipeline_parallel_size = int(pipeline_parallel_size)
        self.data_parallel_size = int(data_parallel_size)
        self.expert_parallel_size = int(expert_parallel_size)
        self._groups: dict = {}
        self.timeout = datetime.timedelta(seconds=timeout_s)

        self.set_device()  # before any group exists: a bad NANOTRON_EXT_DEVICE fails every rank alike
        keep_freed_memory()  # the CPU runtime trains as calibration times its blocks (nanotron_ext/allocator.py)
        _init_gloo(world_size, self.timeout)
        if _UPSTREAM_SIGNATURE:
            # Upstream main's context has more groups (context parallel, local, a 5-D rank matrix) and only checks
            # its backend *argument*: with gloo already up and set_device a no-op, its own __init__ builds them.
            os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])  # one machine
            ParallelContext.__init__(
                self,
                self.tensor_parallel_size,
                self.pipeline_parallel_size,
                self.data_parallel_size,
                expert_parallel_size=self.expert_parallel_size,
            )
            return
        # Same as Nanotron 0.2: a dedicated group spanning every rank.
        self.world_pg = dist.new_group(ranks=list(range(world_size)), timeout=self.timeout, backend="gloo")
        self._init_parallel_groups()

    def create_new_group(self, all_groups_ranks: np.ndarray) -> dist.ProcessGroup:
        """Nanotron's ``create_new_group`` with this context's timeout instead of the 10 minute default.

        Args:
            all_groups_ranks: one row of global ranks per group; every rank must call this with the same rows.

        Returns:
            The group among them that contains this rank.
        """
        dist.barrier()
        rank = int(os.environ["RANK"])
        new_group_containing_rank = None
        for group_ranks in all_groups_ranks:
            sorted_ranks = tuple(sorted(int(r) for r in group_ranks))
            if sorted_ranks not in self.world_ranks_to_pg:
                new_group = dist.new_group(ranks=[int(r) for r in group_ranks], timeout=self.timeout)
                self.world_ranks_to_pg[sorted_ranks] = new_group
            else:
                new_group = self.world_ranks_to_pg[sorted_ranks]
            if rank in sorted_ranks:
                new_group_containing_rank = new_group
        dist.barrier()
        return new_group_containing_rank

    def set_device(self) -> None:
        """Select this rank's CUDA device under ``NANOTRON_EXT_DEVICE=cuda`` (:mod:`nanotron_ext.runtime.device`);
        nothing on CPU. Nanotron's version calls ``torch.cuda.set_device`` unconditionally.

        Raises:
            ConfigError: ``$NANOTRON_EXT_DEVICE`` is not a device this machine has.
        """
        device = device_from_env()
        if device.type == "cuda":
            torch.cuda.set_device(device)

    def __enter__(self) -> GlooParallelContext:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Destroy the groups: with a barrier on a clean exit, without one on an error (which propagates).

        gloo's raw error from a collective becomes a :func:`comm_failure` message first, while the groups still
        exist to name the ranks (a pipeline send or receive has already named its peer: ``CPUP2P``)."""
        failure = None
        if isinstance(exc, RuntimeError) and not isinstance(exc, NanotronExtError):
            failure = comm_failure(exc, peer=None, what="a collective (barrier, all-reduce or gather)")
        self.destroy(barrier=exc_type is None)
        if failure is not None:
            raise failure from None

    def destroy(self, barrier: bool = True) -> None:
        """Tear down the process groups; safe to call more than once or after a failed start.

        Args:
            barrier: wait for every rank first, as Nanotron does. Pass False when another rank may be dead.
        """
        if not torch_dist.is_initialized():
            return
        if barrier:
            try:
                torch_dist.barrier()
            except RuntimeError:
                # A peer already left (or timed out); still release our own resources.
                pass
        torch_dist.destroy_process_group()


def _check_world(
    tensor_parallel_size: int, pipeline_parallel_size: int, data_parallel_size: int, expert_parallel_size: int
) -> int:
    """``WORLD_SIZE``, once the sizes are positive integers whose product it is, under torchrun's variables."""
    sizes = {
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
        "data_parallel_size": data_parallel_size,
        "expert_parallel_size": expert_parallel_size,
    }
    for name, value in sizes.items():
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")

    missing = [key for key in RENDEZVOUS_VARIABLES if key not in os.environ]
    if missing:
        raise ValueError(
            f"GlooParallelContext needs the torchrun environment variables {', '.join(RENDEZVOUS_VARIABLES)}; "
            f"missing: {', '.join(missing)}. Launch with `torchrun --nproc_per_node=N ...` or set them."
        )

    world_size = int(os.environ["WORLD_SIZE"])
    needed = tensor_parallel_size * pipeline_parallel_size * data_parallel_size * expert_parallel_size
    if needed != world_size:
        raise ValueError(
            f"WORLD_SIZE={world_size} but tp*pp*dp*ep = {tensor_parallel_size}*{pipeline_parallel_size}*"
            f"{data_parallel_size}*{expert_parallel_size} = {needed}. Launch {needed} processes "
            f"(torchrun --nproc_per_node={needed}) or change the parallel sizes so their product is "
            f"{world_size}."
        )
    return world_size


def _init_gloo(world_size: int, timeout: datetime.timedelta) -> None:
    """The default process group over gloo (or the one that exists, if it is gloo)."""
    if not torch_dist.is_initialized():
        torch_dist.init_process_group(
            backend="gloo",
            rank=int(os.environ["RANK"]),
            world_size=world_size,
            timeout=timeout,
        )
    elif torch_dist.get_backend() != "gloo":
        raise RuntimeError(
            f"A default process group with backend {torch_dist.get_backend()!r} already exists; "
            "GlooParallelContext needs gloo (CPU). Destroy the existing group first."
        )


#: gloo's words for a peer that stopped answering, and for one whose process is gone.
_TIMEOUT = re.compile(r"Timed out waiting (\d+)ms")
_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Connection refused",
    "connection closed",
    "EOF",
)


def comm_failure(exc: BaseException, *, peer: int | None, what: str) -> RunFailure | None:
    """gloo's raw error as a message that names the peer and the setting, or None when it is not a
    communication failure.

    The message has one form whatever was in flight: which operation a rank is blocked in when a peer goes
    silent depends on timing (a receive in the pipeline, or the gradient-norm all-reduce after it), so the
    message leads with what is certain, the silent peer and the wait, and says the operation after.

    Args:
        exc: what gloo raised.
        peer: the global rank waited on, when known (point-to-point); None for a collective, where in a world
            of two ranks it can only be the other one.
        what: what was being exchanged ("activations or gradients", "the gradient all-reduce").
    """
    text = str(exc)
    me = dist.get_rank() if dist.is_initialized() else "?"
    if peer is None and dist.is_initialized() and dist.get_world_size() == 2:
        peer = 1 - int(me)
    who = f"rank {peer}" if peer is not None else "a peer rank"
    match = _TIMEOUT.search(text)
    if match:
        seconds = int(match.group(1)) / 1e3
        return RunFailure(
            f"rank {me} waited {seconds:g} s for {who}, which stopped answering (stopped, hung or overloaded), "
            f"during {what}; its process may still be alive. If it is only slow, raise {TIMEOUT_ENV} (now "
            f"{seconds:g} s)"
        )
    if any(word in text for word in _GONE):
        return RunFailure(
            f"rank {me} lost {who} during {what}: its process exited or was killed; see that "
            f"rank's own error, if it printed one"
        )
    return None
