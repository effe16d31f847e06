"""Fetching the http(s) URLs of images, videos and audio clips in prompts without server-side request forgery.

A chat message's `image_url` (`video_url`, `audio_url`) makes the server open a connection where the client says,
so a fetch must not reach what only the server can reach:
- Only http and https URLs without user info; the host is resolved once (getaddrinfo) and refused if ANY of its
  addresses is not a public unicast address (`is_public_address`: loopback, private, link-local, carrier-grade NAT,
  multicast, reserved, unspecified, site-local, and IPv6 forms embedding such an IPv4 address). The connection goes
  to a vetted address itself (the name is not resolved again, so DNS rebinding between the check and the connect has
  nothing to win), with the name in the Host header and, for https, as SNI and for the certificate check.
- Redirects (301, 302, 303, 307, 308; at most MAX_REDIRECTS) are followed by hand, each hop checked as the first.
- One deadline for the whole fetch (name lookup, connects, TLS, redirects, body): every socket wait is cut to the
  time left, so a server dripping bytes cannot hold the fetching thread past it; at most `limit` bytes are read (a
  larger Content-Length is refused before the body).
- Every failure once the fetch has started (a refused address, a failed lookup, a refused connection, a status other
  than 200, a timeout, a body too large, a bad redirect) reads the same, "could not fetch the image URL", so errors
  are no oracle for probing the server's network; the reason is logged at debug level.
`FetchPolicy.allowed_domains` (EngineConfig.allowed_media_domains, `--allowed-media-domains`, as vLLM's flag) limits
fetches to those hosts and their subdomains, and trusts them at any address (a deployment's internal media server).
"""
from __future__ import annotations

import http.client
import io
import ipaddress
import logging
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union
from urllib.parse import SplitResult, urljoin, urlsplit

if TYPE_CHECKING:
    from streamer.config import EngineConfig

logger = logging.getLogger(__name__)

FETCH_DEADLINE_S = 15.0  # one fetch, all of it (lookup, connects, redirects, body)
MAX_REDIRECTS = 5
REDIRECTS = (301, 302, 303, 307, 308)
_CHUNK = 64 << 10
Address = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]

# Not public, whatever a Python version's ipaddress tables say (they have grown over versions)
_BLOCKED = tuple(ipaddress.ip_network(n) for n in (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12", "192.0.0.0/24",
    "192.0.2.0/24", "192.88.99.0/24", "192.168.0.0/16", "198.18.0.0/15", "198.51.100.0/24", "203.0.113.0/24",
    "224.0.0.0/4", "240.0.0.0/4",
    "::/96", "::ffff:0:0/96", "64:ff9b:1::/48", "100::/64", "2001::/23", "2001:db8::/32", "fc00::/7", "fe80::/10",
    "fec0::/10", "ff00::/8"))
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # the well-known NAT64 prefix: the address is its last 32 bits


def is_public_address(addr: Union[str, Address]) -> bool:
    """Whether a fetch may connect to `addr`: a globally routable unicast address, and for IPv6 forms that embed an
    IPv4 address (mapped, 6to4, NAT64), that IPv4 address is one too."""
    if isinstance(addr, str):
        addr = ipaddress.ip_address(addr)
    if isinstance(addr, ipaddress.IPv6Address):
        embedded = addr.ipv4_mapped or addr.sixtofour
        if embedded is None and addr in _NAT64:
            embedded = ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)
        if embedded is not None:
            return is_public_address(embedded)
        if addr.is_site_local or addr.teredo is not None:
            return False
    if any(addr in net for net in _BLOCKED if net.version == addr.version):
        return False
    return addr.is_global and not (addr.is_multicast or addr.is_private or addr.is_loopback or addr.is_link_local
                                   or addr.is_reserved or addr.is_unspecified)


def _ip(host: str) -> Optional[Address]:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def normalize_host(host: str) -> str:
    """A host name as compared with an allow-list: lower case, no brackets or trailing dot, IDNA-encoded (ASCII);
    an IP address in its canonical spelling. ValueError for one that cannot be a host."""
    h = host.strip().lower()
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    ip = _ip(h)
    if ip is not None:
        return str(ip)
    h = h.rstrip(".")
    if not h or any(c in h for c in "/:@?#[]\\% \t"):
        raise ValueError(f"not a host name or IP address: {host!r}")
    return h.encode("idna").decode("ascii")  # (UnicodeError, a ValueError, for an impossible name)


def normalize_domains(value: Any, name: str = "allowed_media_domains") -> Optional[tuple[str, ...]]:
    """None, or a list/tuple of host names or IP addresses as a tuple of `normalize_host`'s; ValueError naming
    `name` for anything else."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v.strip() for v in value):
        raise ValueError(f"{name} must be None or a list of host names or IP addresses, got {value!r}")
    try:
        return tuple(dict.fromkeys(normalize_host(v) for v in value))
    except ValueError as e:
        raise ValueError(f"{name} must be host names or IP addresses (no scheme, port or path): {e}") from None


@dataclass(frozen=True)
class FetchPolicy:
    """Which http(s) media URLs may be fetched. allow_remote False: none (data: URLs only). allowed_domains None:
    any host all of whose addresses are public; else only hosts equal to an entry or a subdomain of one (an IP
    address entry: that address), trusted at whatever address they have. deadline_s: one fetch's whole time."""
    allow_remote: bool = True
    allowed_domains: Optional[tuple[str, ...]] = None
    deadline_s: float = FETCH_DEADLINE_S

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed_domains", normalize_domains(self.allowed_domains, "allowed_domains"))

    @classmethod
    def of(cls, config: "EngineConfig") -> "FetchPolicy":
        """The policy of an engine's config (allow_image_urls, allowed_media_domains)."""
        return cls(config.allow_image_urls, config.allowed_media_domains)

    def trusts(self, host: str) -> bool:
        """Whether `host` (a URL's) is on the allow-list (False without one)."""
        if self.allowed_domains is None:
            return False
        try:
            h = normalize_host(host)
        except ValueError:
            return False
        if _ip(h) is not None:
            return h in self.allowed_domains
        return any(h == d or (h.endswith("." + d) and _ip(d) is None) for d in self.allowed_domains)



DEFAULT_POLICY = FetchPolicy()  # (frozen: one shared default is safe)


class _Refused(Exception):
    """A fetch failed; the reason is for the debug log only."""


class _Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError("the fetch's deadline passed")
        return left


def fetch(url: str, policy: FetchPolicy, what: str, limit: int) -> bytes:
    """The body of an http(s) URL under `policy`, at most `limit` bytes, within policy.deadline_s. ValueError: the
    URL is not one to fetch (malformed, or not on the allow-list), or "could not fetch the {what} URL" for any
    failure of the fetch itself."""
    if not policy.allow_remote:
        raise ValueError(f"this server does not fetch {what} URLs; send the {what} as a data: URL")
    try:
        first = _parse(url)
    except _Refused:
        raise ValueError(f"the {what} URL is not a valid http(s) URL") from None
    if policy.allowed_domains is not None and not policy.trusts(first.hostname or ""):
        raise ValueError(f"this server fetches {what} URLs only from its allowed media domains")
    deadline = _Deadline(policy.deadline_s)
    try:
        return _fetch(url, policy, limit, deadline)
    except (_Refused, OSError, http.client.HTTPException, ValueError) as e:  # (ssl.SSLError, TimeoutError: OSError)
        logger.debug("fetching %s URL %.200s failed: %s: %s", what, url, type(e).__name__, e)
    raise ValueError(f"could not fetch the {what} URL")


def _parse(url: str) -> SplitResult:
    try:
        parts = urlsplit(url)
        _ = parts.port  # (ValueError for a port out of range or not a number)
    except ValueError as e:
        raise _Refused(f"malformed URL: {e}") from None
    if parts.scheme not in ("http", "https"):
        raise _Refused(f"scheme {parts.scheme!r}")
    if "@" in parts.netloc:
        raise _Refused("user info in the URL")
    if not parts.hostname:
        raise _Refused("no host")
    if parts.port == 0:
        raise _Refused("port 0")
    return parts


def _fetch(url: str, policy: FetchPolicy, limit: int, deadline: _Deadline) -> bytes:
    for _ in range(MAX_REDIRECTS + 1):
        parts = _parse(url)
        host = normalize_host(parts.hostname or "")  # (IDNA: the name as DNS, the Host header and SNI spell it)
        trusted = policy.trusts(host)
        if policy.allowed_domains is not None and not trusted:
            raise _Refused(f"host {host!r} is not an allowed media domain")
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        addrs = _resolve(host, port, deadline)
        if not trusted:
            bad = [str(a) for _, _, a in addrs if not is_public_address(a)]
            if bad:
                raise _Refused(f"{host!r} resolves to non-public addresses {bad}")
        conn = _PinnedConnection(host, port, addrs, deadline, tls)
        try:
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            host_header = (f"[{host}]" if ":" in host else host) + ("" if parts.port in (None, 443 if tls else 80)
                                                                    else f":{port}")
            conn.request("GET", target, headers={"Host": host_header, "User-Agent": "streamer",
                                                 "Accept-Encoding": "identity", "Connection": "close"})
            resp = conn.getresponse()
            if resp.status in REDIRECTS:
                location = resp.getheader("Location")
                if not location:
                    raise _Refused(f"HTTP {resp.status} without a Location")
                url = urljoin(url, location.strip())
                continue
            if resp.status != 200:
                raise _Refused(f"HTTP {resp.status}")
            if resp.length is not None and resp.length > limit:
                raise _Refused(f"Content-Length {resp.length} > {limit}")
            data, expected = bytearray(), resp.length
            while True:
                deadline.left()
                chunk = resp.read(min(_CHUNK, limit + 1 - len(data)))
                if not chunk:
                    if expected is not None and len(data) < expected:
                        raise _Refused(f"the body ended after {len(data)} of {expected} bytes")
                    return bytes(data)
                data += chunk
                if len(data) > limit:
                    raise _Refused(f"the body is larger than {limit} bytes")
        finally:
            conn.dispose()
    raise _Refused(f"more than {MAX_REDIRECTS} redirects")


def _resolve(host: str, port: int, deadline: _Deadline) -> list[tuple[int, tuple, Address]]:
    """The host's addresses as (family, sockaddr, address), looked up on a thread of its own so that a slow
    resolver counts against the deadline."""
    result: dict[str, Any] = {}

    def lookup() -> None:
        try:
            result["infos"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except Exception as e:  # (socket.gaierror, UnicodeError for an impossible name)
            result["error"] = e

    worker = threading.Thread(target=lookup, name="media-fetch-dns", daemon=True)
    worker.start()
    worker.join(deadline.left())
    if worker.is_alive():
        raise TimeoutError(f"looking up {host!r} took past the deadline")
    if "error" in result:
        raise _Refused(f"looking up {host!r} failed: {result['error']}")
    addrs: dict[Address, tuple[int, tuple, Address]] = {}
    for family, _, _, _, sockaddr in result["infos"]:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        addr = ipaddress.ip_address(sockaddr[0].split("%", 1)[0])
        addrs.setdefault(addr, (family, sockaddr, addr))
    if not addrs:
        raise _Refused(f"{host!r} has no addresses")
    return list(addrs.values())


class _PinnedConnection(http.client.HTTPConnection):
    """An HTTP(S) connection to vetted addresses (tried in order), never to whatever the name resolves to later;
    every socket wait ends by the deadline."""

    def __init__(self, host: str, port: int, addrs: Sequence[tuple[int, tuple, Address]], deadline: _Deadline,
                 tls: bool) -> None:
        super().__init__(host, port)
        self._addrs, self._deadline, self._tls = addrs, deadline, tls
        self._raw: Optional[socket.socket] = None

    def connect(self) -> None:
        error: Optional[OSError] = None
        for family, sockaddr, _ in self._addrs:
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.settimeout(self._deadline.left())
                sock.connect(sockaddr)
                if self._tls:  # (do_handshake's timeout bounds the whole handshake)
                    sock = _tls_context().wrap_socket(sock, server_hostname=self.host)
            except OSError as e:
                sock.close()
                error = e
                if isinstance(e, TimeoutError):
                    break
                continue
            self._raw = sock
            self.sock = _DeadlineSocket(sock, self._deadline)  # type: ignore[assignment]
            return
        raise error or OSError("no address to connect to")

    def dispose(self) -> None:
        """Close the connection and its socket (which `close` leaves open: http.client calls it as soon as a
        response says Connection: close, before its body is read)."""
        self.close()
        if self._raw is not None:
            self._raw.close()
            self._raw = None


def _tls_context() -> ssl.SSLContext:
    """The system's CAs, the certificate checked against the URL's host."""
    return ssl.create_default_context()


class _DeadlineSocket:
    """A connected socket whose sends and receives each wait at most the time left before the deadline (so that a
    trickle of bytes, each arriving within a per-read timeout, still ends at the deadline)."""

    def __init__(self, sock: socket.socket, deadline: _Deadline) -> None:
        self._sock, self._deadline = sock, deadline

    def sendall(self, data: bytes) -> None:
        self._sock.settimeout(self._deadline.left())
        self._sock.sendall(data)

    def makefile(self, mode: str = "rb", *args: Any, **kwargs: Any) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))

    def close(self) -> None:  # (the connection's `dispose` closes the socket)
        pass


class _DeadlineReader(io.RawIOBase):
    def __init__(self, sock: socket.socket, deadline: _Deadline) -> None:
        self._sock, self._deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        self._sock.settimeout(self._deadline.left())
        return self._sock.recv_into(buf)
