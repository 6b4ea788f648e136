"""Prints every transition table of the protocol as markdown: the job tables (`kvsvc.core.jobs`) and the window-round
tables (`kvsvc.core.windows`), as docs/protocol.md shows them (a test keeps the two the same). Run `python -m
kvsvc.core.tables`. Pure module: imports the two table modules only.
"""

from __future__ import annotations

from kvsvc.core.jobs import RECV_TABLE, SEND_TABLE, table_markdown
from kvsvc.core.windows import FILL_TABLE, SCATTER_TABLE


def main() -> None:
    print(f"Send job (P):\n\n{table_markdown(SEND_TABLE)}\n")
    print(f"Receive job (D):\n\n{table_markdown(RECV_TABLE)}\n")
    print(f"Filling a window (P):\n\n{table_markdown(FILL_TABLE)}\n")
    print(f"A lent window (D):\n\n{table_markdown(SCATTER_TABLE)}")


if __name__ == "__main__":
    main()
