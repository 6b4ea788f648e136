"""Real vLLM engines in child processes, for the vLLM benchmarks, the disaggregated example and the vLLM tests: the
harness (`engines`: `VllmEngine`, a tiny random-weight Llama), the child it drives (`child`) and vLLM's CPU worker with
its eager-mode warm-up (`warm_worker`)."""
