"""`WarmCPUWorker`: vLLM's CPU worker with the warm-up that eager mode skips, for tests, examples and the bench
(`worker_cls="kvsvc.testing.vllm_worker.WarmCPUWorker"`).

vLLM's CPU worker warms its model up only when something is compiled; in eager mode (`enforce_eager`) it skips the
dummy run, and two things then happen at the first real step instead:
- on a later pipeline stage, the buffer the stage receives the previous stage's activations into is never allocated,
  and that step fails (`assert self.intermediate_tensors is not None`);
- with tensor parallel size above 1, the masked vocabulary embedding is compiled by torch (inductor) and vLLM's CPU
  communicator sets itself up; on a 2-core host that stalls every process for tens of seconds, kvsvc's transfer
  threads in the other engines included (a first transfer then runs into its deadline).
This worker runs the dummy run at start, as a compiled engine does, then resets the random seed as vLLM's warm-up
does. Nothing of vLLM's files is touched. Imports vllm at module level: vLLM loads it by its dotted path, in its worker
processes, never kvsvc itself.
"""

from __future__ import annotations

from typing import Any

from vllm.config import CompilationMode
from vllm.v1.worker.cpu_worker import CPUWorker


class WarmCPUWorker(CPUWorker):
    """A `CPUWorker` that runs its model once at start in eager mode too (see module docstring)."""

    def compile_or_warm_up_model(self) -> Any:
        runner: Any = self.model_runner
        if self.vllm_config.compilation_config.mode == CompilationMode.NONE:
            runner.profile_run()  # what `warming_up_model` runs when something is compiled
        return super().compile_or_warm_up_model()  # resets the random seed after it


WORKER_CLS = f"{__name__}.WarmCPUWorker"
"""The dotted path to give vLLM as `worker_cls`."""
