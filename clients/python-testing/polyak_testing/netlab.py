"""Test hosts and cut links: network namespaces on a bridge, and a TCP
proxy whose connections a test can cut (a partition) or whose next answer
it can lose."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import subprocess
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .server import PolyakServer


class NetLab:
    """Test hosts on this machine: network namespaces (``ip netns``) joined
    by veth pairs to one bridge, on a /24 of their own (10.231.N.0/24; the
    bridge is .1, host ``i`` is .(10 + i)). Each host's link can be cut
    (its veth set down) without touching what runs in it. Needs root and
    ``ip``; :meth:`unavailable` says why not otherwise. Services on this
    machine's loopback are reached from a host through a
    :class:`TcpProxy` listening on the bridge address (:meth:`proxy`)."""

    def __init__(self) -> None:
        tag = os.getpid() % 10000
        self.prefix = f"pk{tag}"
        self.subnet = f"10.231.{20 + os.getpid() % 200}"
        self.bridge = f"{self.prefix}br"
        self.gateway = f"{self.subnet}.1"
        self.hosts: list[LabHost] = []
        self._proxies: list[TcpProxy] = []
        self._up = False

    @staticmethod
    def unavailable() -> str | None:
        """Why namespaces cannot be made here (``None``: they can)."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        if shutil.which("ip") is None:
            return "no `ip` command (iproute2)"
        probe = f"pkprobe{os.getpid() % 100000}"
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        if made.returncode != 0:
            return f"`ip netns add` failed: {made.stderr.strip()}"
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
        return None

    @staticmethod
    def _ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    def start(self) -> NetLab:
        self._ip("link", "add", self.bridge, "type", "bridge")
        self._up = True
        self._ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        self._ip("link", "set", self.bridge, "up")
        return self

    def host(self) -> LabHost:
        """A new host: its namespace, with a veth to the bridge."""
        i = len(self.hosts)
        host = LabHost(
            ns=f"{self.prefix}h{i}",
            ip=f"{self.subnet}.{10 + i}",
            link=f"{self.prefix}v{i}",
        )
        peer = f"{self.prefix}p{i}"
        self._ip("netns", "add", host.ns)
        self.hosts.append(host)
        self._ip("link", "add", host.link, "type", "veth", "peer", "name", peer)
        self._ip("link", "set", peer, "netns", host.ns)
        self._ip("link", "set", host.link, "master", self.bridge, "up")
        inside = ("netns", "exec", host.ns, "ip")
        self._ip(*inside, "addr", "add", f"{host.ip}/24", "dev", peer)
        self._ip(*inside, "link", "set", peer, "up")
        self._ip(*inside, "link", "set", "lo", "up")
        return host

    def proxy(self, target: tuple[str, int]) -> TcpProxy:
        """``target`` (on this machine's loopback) as the hosts reach it: a
        proxy on the bridge address (one per target)."""
        for proxy in self._proxies:
            if proxy.target == target:
                return proxy
        proxy = TcpProxy(target, listen=self.gateway)
        self._proxies.append(proxy)
        return proxy

    def reach_url(self, url: str) -> str:
        """``url`` (``postgres://user@host:port/db``, ``http://host:port``)
        with its address replaced by its proxy's, for the hosts."""
        head, sep, rest = url.partition("://")
        auth, at, hostpart = rest.rpartition("@")
        netloc, slash, path = hostpart.partition("/")
        host, _, port = netloc.rpartition(":")
        proxy = self.proxy((host, int(port)))
        return f"{head}{sep}{auth}{at}{self.gateway}:{proxy.port}{slash}{path}"

    def close(self) -> None:
        for proxy in self._proxies:
            proxy.close()
        for host in self.hosts:
            subprocess.run(["ip", "link", "del", host.link], capture_output=True)
            subprocess.run(["ip", "netns", "del", host.ns], capture_output=True)
        self.hosts.clear()
        if self._up:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
            self._up = False


class LabHost:
    """One host of a :class:`NetLab`: its namespace, its address, and the
    bridge side of its link."""

    def __init__(self, ns: str, ip: str, link: str) -> None:
        self.ns = ns
        self.ip = ip
        self.link = link

    def run_in(self, server: PolyakServer) -> PolyakServer:
        """Makes ``server`` start in this host, bound to its address (which
        only the test net reaches: served without a token)."""
        server.prefix = ["ip", "netns", "exec", self.ns]
        server.host = self.ip
        if "--insecure" not in server.args:
            server.args.append("--insecure")
        return server

    def cut(self) -> None:
        """Its link down: nothing reaches it and it reaches nothing."""
        NetLab._ip("link", "set", self.link, "down")

    def mend(self) -> None:
        NetLab._ip("link", "set", self.link, "up")


class TcpProxy:
    """Forwards ``listen:<port>`` (default ``127.0.0.1``) to ``target``
    (host, port) until
    :meth:`cut`, which drops every connection and refuses new ones (a link
    cut between a server and what it reaches), until :meth:`mend`. Setting
    :attr:`lose_next` loses the next answer: the request is forwarded, the
    response swallowed and the connection closed (a network failure after
    the server acted); :attr:`lost` counts them. Setting :attr:`garble_at`
    flips one bit at that byte of the answers of the next
    :attr:`garble_left` connections (counted from each connection's first
    byte from the target: bytes damaged on the way); :attr:`garbled`
    counts them. Setting :attr:`cut_partial_bodies` ends every connection
    whose first answer is a ``206`` right after its headers (a body cut
    before its first byte); :attr:`bodies_cut` counts them."""

    def __init__(self, target: tuple[str, int], listen: str = "127.0.0.1") -> None:
        self.target = target
        self.host = listen
        self._listener = socket.create_server((listen, 0))
        self.port = int(self._listener.getsockname()[1])
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        self._cut = False
        self._closed = False
        self.lose_next = threading.Event()
        self.lost = 0
        self.garble_at: int | None = None
        self.garble_left = 0
        self.garbled = 0
        self.cut_partial_bodies = False
        self.bodies_cut = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                if self._cut:
                    client.close()
                    continue
                try:
                    upstream = socket.create_connection(self.target, timeout=5)
                except OSError:
                    client.close()
                    continue
                upstream.settimeout(None)
                self._open += [client, upstream]
            for a, b, answers in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(target=self._pipe, args=(a, b, answers), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, answers: bool) -> None:
        seen = 0
        garble: int | None = None
        try:
            while data := src.recv(65536):
                if answers and self.lose_next.is_set():
                    self.lose_next.clear()
                    self.lost += 1
                    break
                if answers and seen == 0 and self.cut_partial_bodies:
                    head = data.find(b"\r\n\r\n")
                    if data.startswith(b"HTTP/1.1 206") and head >= 0:
                        dst.sendall(data[: head + 4])
                        with self._lock:
                            self.bodies_cut += 1
                        break
                if answers and seen == 0:
                    with self._lock:
                        if self.garble_at is not None and self.garble_left > 0:
                            self.garble_left -= 1
                            garble = self.garble_at
                if garble is not None and seen <= garble < seen + len(data):
                    damaged = bytearray(data)
                    damaged[garble - seen] ^= 0x10
                    data = bytes(damaged)
                    with self._lock:
                        self.garbled += 1
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        """Drops every connection (reset) and refuses new ones."""
        with self._lock:
            self._cut = True
            for s in self._open:
                try:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    s.close()
                except OSError:
                    pass
            self._open.clear()

    def mend(self) -> None:
        with self._lock:
            self._cut = False

    def close(self) -> None:
        self._closed = True
        self.cut()
        self._listener.close()
