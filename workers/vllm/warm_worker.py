"""`WarmCPUWorker`: vLLM's CPU worker with the warm-up that eager mode skips, for tests, examples and the bench
(`worker_cls="workers.vllm.warm_worker.WarmCPUWorker"`).

vLLM's CPU worker warms its model up only when something is compiled; in eager mode (`enforce_eager`) it skips the
dummy run, and two things then happen at the first real step instead:
- on a later pipeline stage, the buffer the stage receives the previous stage's activations into is never allocated,
  and that step fails (`assert self.intermediate_tensors is not None`);
- with tensor parallel size above 1, the masked vocabulary embedding is compiled by torch (inductor) and vLLM's CPU
  communicator sets itself up; on a 2-core host that stalls every process for tens of seconds, kvsvc's transfer
  threads in the other engines included (a first transfer then runs into its deadline).
This worker runs the dummy run at start, as a compiled engine does, then resets the random seed as vLLM's warm-up
does.

`calm_waits` (applied when this module loads, so in every worker process, and by the test engine's own process)
makes vLLM's shared-memory queues wait for a message by blocking, never by spinning: a reader spins on
`sched_yield` for a second after each message, so an engine that steps while its requests wait for KV keeps every
process of it spinning, and on a 2-core host the other engines' processes (kvsvc's transfer threads among them) got
no CPU for tens of seconds at a time. Nothing of vLLM's files is touched. Imports vllm at module level: vLLM loads
this module by its dotted path, in its worker processes, never kvsvc itself.
"""

from __future__ import annotations

from typing import Any

from vllm.config import CompilationMode
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
from vllm.v1.worker.cpu_worker import CPUWorker


def calm_waits() -> None:
    """Make every reader of vLLM's shared-memory queues in this process block for its next message instead of
    spinning first (module docstring). Idempotent."""
    if getattr(SpinCondition, "_kvsvc_calm", False):
        return
    spinning_wait = SpinCondition.wait

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        self.busy_loop_s = 0  # the writer notifies every message: blocking costs a wake-up, not a message
        spinning_wait(self, timeout_ms)

    SpinCondition.wait = wait  # type: ignore[method-assign]
    SpinCondition._kvsvc_calm = True  # type: ignore[attr-defined]


calm_waits()


class WarmCPUWorker(CPUWorker):
    """A `CPUWorker` that runs its model once at start in eager mode too (see module docstring)."""

    def compile_or_warm_up_model(self) -> Any:
        runner: Any = self.model_runner
        if self.vllm_config.compilation_config.mode == CompilationMode.NONE:
            runner.profile_run()  # what `warming_up_model` runs when something is compiled
        return super().compile_or_warm_up_model()  # resets the random seed after it


WORKER_CLS = f"{__name__}.WarmCPUWorker"
"""The dotted path to give vLLM as `worker_cls`."""
