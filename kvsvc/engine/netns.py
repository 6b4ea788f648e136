"""Separate network hosts on one machine: joining a named Linux network namespace from the calling thread (`join`),
and `NetnsHosts`, namespaces joined by a private switch, with faults applied inside one host.

Joining: a network namespace is a per-thread attribute, so a thread that joins one creates every socket after it
there, and threads it starts later inherit it; join before the first socket (a worker process joins first thing, the
endpoint thread before its loop binds). `setns(2)` comes through ctypes (Python's `os` gains it only in 3.12).

Hosts: each is a namespace with its own loopback and one interface `eth0` with a 10.213.0.0/24 address; a further
namespace holds the bridge every host's link plugs into, so nothing reaches the machine's own network and the
addresses cannot collide with anything outside. `partition` and `loss` are iptables rules on a host's `eth0` (both
directions, loopback untouched), `link` sets `eth0` down or up.

Rules: needs root, iproute2 and iptables (`skip_reason` says which is missing); namespace names carry the creating
process's pid, and `close` (also on errors in `__enter__`) deletes every namespace it made, which deletes the links
too; namespaces left by a process that died are removed by the next `NetnsHosts` to start. Every command has a
deadline. Used by the multi-host tests and `kvsvc demo --hosts netns`; a production engine never calls any of it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Sequence
from typing import Final, Self, TypeVar

NETNS_DIR: Final = "/var/run/netns"
_CLONE_NEWNET: Final = 0x40000000


class NetnsError(OSError):
    """The namespace does not exist, or this process may not join it (joining needs CAP_SYS_ADMIN)."""


def join(name: str) -> None:
    """Move the calling thread into network namespace `name` (a file under /var/run/netns).

    Raises:
        NetnsError: no such namespace, or setns(2) refused (its errno and message are in the text).
    """
    path = os.path.join(NETNS_DIR, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise NetnsError(exc.errno, f"network namespace {name!r}: cannot open {path}: {exc.strerror}") from None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise NetnsError(errno, f"network namespace {name!r}: setns failed: {os.strerror(errno)}")
    finally:
        os.close(fd)


T = TypeVar("T")

PREFIX: Final = "kvsvc-net-"
SUBNET: Final = "10.213.0"
_COMMAND_TIMEOUT_S: Final = 10.0


class HostsError(RuntimeError):
    """A namespace, link or firewall command failed (the command and its stderr are in the message)."""


def skip_reason() -> str | None:
    """Why namespaces cannot be made here (a sentence for `pytest.skip`), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    for tool, package in (("ip", "iproute2"), ("iptables", "iptables")):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing (Debian package {package})"
    return None


def _run(*argv: str) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise HostsError(f"`{' '.join(argv)}` did not finish within {_COMMAND_TIMEOUT_S:g} s") from None
    except FileNotFoundError:
        raise HostsError(f"`{argv[0]}` is not installed ({skip_reason()})") from None
    if done.returncode != 0:
        raise HostsError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete the namespaces of `NetnsHosts` whose creating process is gone; returns their names."""
    removed: list[str] = []
    with contextlib.suppress(FileNotFoundError):
        for name in sorted(os.listdir(NETNS_DIR)):
            if not name.startswith(PREFIX):
                continue
            pid = name[len(PREFIX) :].split("-", 1)[0]
            if pid.isdigit() and not _pid_alive(int(pid)):
                with contextlib.suppress(HostsError):
                    _run("ip", "netns", "del", name)
                    removed.append(name)
    return removed


def in_netns(name: str, fn: Callable[[], T], timeout_s: float = 60.0) -> T:
    """`fn()` called from a new thread that joined network namespace `name`: its sockets live on that host.

    Raises:
        NetnsError: the namespace cannot be joined. TimeoutError: `fn` did not return within `timeout_s` (it keeps
            running in its daemon thread). Whatever `fn` raises.
    """
    outcome: list[tuple[bool, object]] = []

    def run() -> None:
        try:
            join(name)
            outcome.append((True, fn()))
        except BaseException as exc:
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name=f"in-{name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        raise TimeoutError(f"a call on network namespace {name!r} did not return within {timeout_s:g} s")
    ok, value = outcome[0]
    if not ok:
        assert isinstance(value, BaseException)
        raise value
    return value  # type: ignore[return-value]


class NetnsHosts:
    """Hosts named `names` (each a namespace with one address) on a private switch. A context manager.

    `netns(host)` is the namespace a process joins (`kvsvc.engine.netns.join`), `address(host)` its non-loopback
    address.
    """

    _serial = 0

    def __init__(self, names: Sequence[str]) -> None:
        """Raises:
        ValueError: no names, a repeated one, or more hosts than the /24 holds."""
        if not names or len(set(names)) != len(names):
            raise ValueError(f"host names must be distinct and at least one, got {list(names)}")
        if len(names) > 250:
            raise ValueError(f"at most 250 hosts fit {SUBNET}.0/24, got {len(names)}")
        NetnsHosts._serial += 1
        self._tag = f"{PREFIX}{os.getpid()}-{NetnsHosts._serial}"
        self.names = list(names)
        self._created: list[str] = []
        self._rules: dict[str, list[list[str]]] = {name: [] for name in names}

    # -- lifecycle -----------------------------------------------------------------------------------------------

    def __enter__(self) -> Self:
        """Build the switch and the hosts.

        Raises:
            HostsError: a command failed or `ip` is missing (whatever was made is removed first).
        """
        remove_stale()
        try:
            switch = self._add_namespace("sw")
            _run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", switch, "link", "set", "br0", "up")
            for index, name in enumerate(self.names):
                ns = self._add_namespace(f"h{index}")
                port = f"p{index}"
                _run("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", switch)
                _run("ip", "-n", switch, "link", "set", port, "master", "br0")
                _run("ip", "-n", switch, "link", "set", port, "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.address(name)}/24", "dev", "eth0")
                _run("ip", "-n", ns, "link", "set", "eth0", "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Delete every namespace made (their links go with them). Idempotent; raises nothing."""
        while self._created:
            with contextlib.suppress(HostsError):
                _run("ip", "netns", "del", self._created.pop())

    def _add_namespace(self, suffix: str) -> str:
        name = f"{self._tag}-{suffix}"
        _run("ip", "netns", "add", name)
        self._created.append(name)
        return name

    # -- lookups -------------------------------------------------------------------------------------------------

    def _index(self, host: str) -> int:
        try:
            return self.names.index(host)
        except ValueError:
            raise KeyError(f"no host {host!r}; hosts are {self.names}") from None

    def netns(self, host: str) -> str:
        """The namespace of `host`. Raises: KeyError: no such host."""
        return f"{self._tag}-h{self._index(host)}"

    def address(self, host: str) -> str:
        """The address of `host` on the switch. Raises: KeyError: no such host."""
        return f"{SUBNET}.{self._index(host) + 1}"

    def link_bytes(self, host: str) -> tuple[int, int]:
        """(received, sent) bytes counted on `host`'s link since it was made. Raises: KeyError. HostsError."""
        base = "/sys/class/net/eth0/statistics"
        out = _run("ip", "netns", "exec", self.netns(host), "cat", f"{base}/rx_bytes", f"{base}/tx_bytes")
        rx, tx = (int(v) for v in out.split())
        return rx, tx

    def exec_prefix(self, host: str) -> list[str]:
        """The argv prefix that runs a command on `host` (`ip netns exec <ns>`). Raises: KeyError."""
        return ["ip", "netns", "exec", self.netns(host)]

    # -- faults --------------------------------------------------------------------------------------------------

    def partition(self, host: str) -> None:
        """Drop every packet into and out of `host`'s link, silently (no reset reaches either side).

        Raises: KeyError: no such host. HostsError: iptables failed.
        """
        self._add_rules(host, [])

    def loss(self, host: str, probability: float) -> None:
        """Drop each packet into and out of `host`'s link with `probability`.

        Raises: ValueError: probability outside (0, 1]. KeyError. HostsError.
        """
        if not 0 < probability <= 1:
            raise ValueError(f"loss probability must be in (0, 1], got {probability}")
        self._add_rules(host, ["-m", "statistic", "--mode", "random", "--probability", f"{probability:g}"])

    def heal(self, host: str) -> None:
        """Remove the rules `partition` and `loss` added on `host`, each on its own, so one failure leaves no other
        rule behind. Raises: KeyError. HostsError: the first rule that could not be removed (after trying all)."""
        ns = self.netns(host)
        failures: list[HostsError] = []
        while self._rules[host]:
            try:
                _run("ip", "netns", "exec", ns, "iptables", "-w", "5", "-D", *self._rules[host].pop())
            except HostsError as exc:
                failures.append(exc)
        if failures:
            raise failures[0]

    def dropped(self, host: str) -> int:
        """Packets the rules of `partition` and `loss` dropped on `host` so far. Raises: KeyError. HostsError."""
        ns, count = self.netns(host), 0
        for chain in ("INPUT", "OUTPUT"):
            out = _run("ip", "netns", "exec", ns, "iptables", "-w", "5", "-nvxL", chain)
            for line in out.splitlines()[2:]:
                cols = line.split()
                if len(cols) > 2 and cols[2] == "DROP":
                    count += int(cols[0])
        return count

    def link(self, host: str, up: bool) -> None:
        """Set `host`'s link down (as a pulled cable: the address stays, nothing passes) or up again.

        Raises: KeyError. HostsError.
        """
        _run("ip", "-n", self.netns(host), "link", "set", "eth0", "up" if up else "down")

    def _add_rules(self, host: str, match: list[str]) -> None:
        ns = self.netns(host)
        for rule in (["INPUT", "-i", "eth0", *match, "-j", "DROP"], ["OUTPUT", "-o", "eth0", *match, "-j", "DROP"]):
            _run("ip", "netns", "exec", ns, "iptables", "-w", "5", "-A", *rule)
            self._rules[host].append(rule)


__all__ = ["PREFIX", "HostsError", "NetnsHosts", "in_netns", "remove_stale", "skip_reason"]
