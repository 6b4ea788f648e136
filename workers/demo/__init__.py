"""`kvsvc demo`'s runtime (`workers.demo.runner`: options, the run, its result) and its report
(`workers.demo.report`: the summary table); the command (`workers.commands.demo`) parses arguments and calls them.

Imports nothing itself, so importing a submodule costs only that submodule. Never imported by `kvsvc`.
"""
