"""`kvsvc bench`: the worker-side commands (`workers.bench.worker`) and the parent-side runner
(`workers.bench.runner`), plus the baselines it compares kvsvc with. Imports `kvsvc` and `workers`; never imported
by `kvsvc`."""
