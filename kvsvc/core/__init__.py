"""kvsvc's pure core: every protocol decision, as values and tables, with no I/O. Its modules import no asyncio, torch,
mooncake, socket, os or logging (tests/unit/test_pure_core.py holds them to that); the service, the transports, the
engine side and the vLLM connector drive it. README.md's "Layout of the code" says what each module holds.
"""
