"""Images in chat messages: data URIs, raw base64 and safe-by-default http(s) fetching (of audio clips too).

Every refusal is an `InvalidRequest` (HTTP 400, param "image_url") whose message says why.

Fetching is guarded against SSRF: only http(s); the host is resolved once, every resolved address is checked
(loopback, private, link-local, CGNAT, multicast, reserved, unspecified and cloud-metadata addresses are refused,
IPv4-mapped IPv6 unwrapped), and the request goes to the checked IP literal with the original Host header (and
SNI for https), so a second DNS answer cannot swap the address. Redirects are followed by hand, each hop checked
the same way. `MediaPolicy.allowed_hosts` opens chosen hosts (name, IP, or "host:port") past the address check.
The body is streamed under a byte cap and decoded by Pillow with a pixel cap checked from the header before load().
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import socket
import warnings
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import httpx
from PIL import Image as PILImage
from PIL import ImageOps

from lmserve.errors import InvalidRequest
from lmserve.types import Bitmap

PARAM = "image_url"
FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")
"""Formats Pillow may open: the common web ones (never EPS/PDF or other plugins with outside helpers)."""
REDIRECTS = frozenset({301, 302, 303, 307, 308})
CGNAT = ipaddress.ip_network("100.64.0.0/10")
METADATA = frozenset({ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")})
CONTENT_TYPES = {"image": ("image/",), "audio": ("audio/", "application/ogg")}
"""What a fetched URL's content type must begin with, per kind of media (application/octet-stream is taken too)."""
ARTICLES = {"image": "an image", "audio": "audio"}


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    """Limits for images taken from requests; `allowed_hosts` are let through even if private/loopback."""

    allowed_hosts: frozenset[str] = frozenset()
    max_bytes: int = 20 * 2**20
    max_pixels: int = 50_000_000
    connect_timeout: float = 5.0
    read_timeout: float = 15.0
    max_redirects: int = 5
    max_audio_seconds: float = 600.0


@dataclass(frozen=True, slots=True)
class Image:
    """A checked image: the original encoded bytes, their MIME type and the pixel size."""

    data: bytes
    mime: str
    width: int
    height: int


def _refuse(message: str) -> InvalidRequest:
    return InvalidRequest(message, param=PARAM)


def check_image(data: bytes, policy: MediaPolicy) -> Image:
    """Check that `data` is a whole image of an allowed format within the byte and pixel caps."""
    if len(data) > policy.max_bytes:
        raise _refuse(f"image is too large: {len(data)} bytes, the limit is {policy.max_bytes}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PILImage.DecompressionBombWarning)
            with PILImage.open(io.BytesIO(data), formats=FORMATS) as img:  # reads the header only
                width, height, fmt = img.width, img.height, img.format or ""
                if width * height > policy.max_pixels:
                    raise _refuse(f"image has too many pixels: {width}x{height}, the limit is {policy.max_pixels}")
                img.verify()
            with PILImage.open(io.BytesIO(data), formats=FORMATS) as img:
                img.load()  # verify() does not decode everything (e.g. truncated JPEG data)
    except PILImage.DecompressionBombError as e:
        raise _refuse(f"image has too many pixels (decompression bomb): {e}") from None
    except InvalidRequest:
        raise
    except Exception as e:  # Pillow raises many types for bad data: UnidentifiedImageError, OSError, SyntaxError…
        raise _refuse(f"not a valid image ({', '.join(FORMATS)}): {e}") from None
    return Image(data, PILImage.MIME.get(fmt, "application/octet-stream"), width, height)


def to_bitmap(data: bytes) -> Bitmap:
    """Decode a checked image (see `check_image`) into packed RGB pixels for a vision model.

    The EXIF orientation is applied (a phone photo is shown upright) and transparency is laid on white.
    """
    try:
        with PILImage.open(io.BytesIO(data), formats=FORMATS) as img:
            img.seek(0)  # the first frame of an animation
            upright = ImageOps.exif_transpose(img)
            if upright.mode in ("RGBA", "LA", "P", "PA") or "transparency" in upright.info:
                rgba = upright.convert("RGBA")
                rgb = PILImage.new("RGB", rgba.size, (255, 255, 255))
                rgb.paste(rgba, mask=rgba.getchannel("A"))
            else:
                rgb = upright.convert("RGB")
            return Bitmap(rgb.width, rgb.height, rgb.tobytes())
    except Exception as e:  # checked images decode; this guards images that skipped the check
        raise _refuse(f"not a valid image ({', '.join(FORMATS)}): {e}") from None


def _b64decode(text: str, policy: MediaPolicy) -> bytes:
    text = "".join(text.split())
    if len(text) // 4 * 3 > policy.max_bytes:
        raise _refuse(f"image is too large: about {len(text) // 4 * 3} bytes, the limit is {policy.max_bytes}")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise _refuse(f"image is not valid base64: {e}") from None


def decode_data_uri(uri: str, policy: MediaPolicy) -> Image:
    """Decode `data:image/...;base64,...` into a checked image."""
    if not uri[:5].lower() == "data:" or "," not in uri:
        raise _refuse("not a data URI (expected data:image/...;base64,...)")
    meta, _, payload = uri[5:].partition(",")
    parts = [p.strip().lower() for p in meta.split(";")]
    if parts[-1] != "base64":
        raise _refuse("data URI must be base64-encoded (data:image/...;base64,...)")
    mime = parts[0]
    if mime and not mime.startswith("image/") and mime != "application/octet-stream":
        raise _refuse(f"data URI media type {mime!r} is not an image")
    return check_image(_b64decode(payload, policy), policy)


def decode_base64(text: str, policy: MediaPolicy) -> Image:
    """Decode raw base64 (the native `images` field), with or without a data: prefix."""
    if text.lstrip()[:5].lower() == "data:":
        return decode_data_uri(text.strip(), policy)
    return check_image(_b64decode(text, policy), policy)


def blocked_reason(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why fetching from `ip` is refused, or None for a public address."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    checks: tuple[tuple[bool, str], ...] = (
        (ip in METADATA, "cloud metadata"),
        (ip.is_loopback, "loopback"),
        (ip.is_unspecified, "unspecified"),
        (ip.is_link_local, "link-local"),
        (ip in CGNAT, "shared (CGNAT)"),
        (ip.is_multicast, "multicast"),
        (ip.is_reserved, "reserved"),
        (ip.is_private, "private"),
        (not ip.is_global, "non-public"),
    )
    return next((why for hit, why in checks if hit), None)


async def _resolve(url: httpx.URL, policy: MediaPolicy, kind: str = "image") -> str:
    """Resolve `url`'s host once, check every address, and return the IP literal to connect to."""
    if url.scheme not in ("http", "https"):
        raise _refuse(f"{kind} URL scheme {url.scheme!r} is not allowed (only http and https)")
    host = url.raw_host.decode("ascii").lower()
    if not host:
        raise _refuse(f"{kind} URL has no host")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise _refuse(f"cannot resolve {kind} host {host!r}: {e}") from None
    if not infos:
        raise _refuse(f"cannot resolve {kind} host {host!r}")
    allowed = host in policy.allowed_hosts or f"{host}:{port}" in policy.allowed_hosts  # exact host match
    ips = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    for ip in ips:
        why = None if allowed else blocked_reason(ip)
        if why:
            raise _refuse(f"{kind} host {host!r} resolves to a {why} address ({ip}), which is not allowed")
    return str(ips[0])


async def _fetch_one(client: httpx.AsyncClient, url: httpx.URL, policy: MediaPolicy,
                     kind: str) -> bytes | httpx.URL:
    """One hop: the body, or the URL a redirect points to."""
    ip = await _resolve(url, policy, kind)
    target = url.copy_with(host=ip)
    extensions = {"sni_hostname": url.host} if url.scheme == "https" else {}
    host_header = url.netloc.decode("ascii").rpartition("@")[2]
    req = client.build_request("GET", target, headers={"Host": host_header}, extensions=extensions)
    resp = await client.send(req, stream=True)
    try:
        if resp.status_code in REDIRECTS:
            location = resp.headers.get("location")
            if not location:
                raise _refuse(f"{kind} URL redirected ({resp.status_code}) without a Location")
            return url.join(location)
        if resp.status_code != 200:
            raise _refuse(f"{kind} URL answered HTTP {resp.status_code}")
        ctype = resp.headers.get("content-type", "").split(";")[0].strip().lower()
        if not (ctype.startswith(CONTENT_TYPES[kind]) or ctype == "application/octet-stream"):
            raise _refuse(f"{kind} URL content type {ctype or '(none)'!r} is not {ARTICLES[kind]}")
        length = resp.headers.get("content-length", "")
        if length.isdigit() and int(length) > policy.max_bytes:
            raise _refuse(f"{kind} is too large: {length} bytes, the limit is {policy.max_bytes}")
        body = bytearray()
        async for chunk in resp.aiter_bytes():
            body += chunk
            if len(body) > policy.max_bytes:
                raise _refuse(f"{kind} is too large: more than {policy.max_bytes} bytes")
        return bytes(body)
    finally:
        await resp.aclose()


async def fetch_image(url: str, policy: MediaPolicy) -> Image:
    """Fetch an http(s) image under `policy` (SSRF guard on every hop, timeouts, byte and pixel caps)."""
    return check_image(await fetch(url, policy, "image"), policy)


async def fetch(url: str, policy: MediaPolicy, kind: str) -> bytes:
    """The body at an http(s) URL of an image or an audio clip (`kind`, a key of CONTENT_TYPES), fetched under
    `policy`: the SSRF guard on every hop, timeouts, the byte cap, a content type of that kind. Not checked further."""
    try:
        current = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as e:
        raise _refuse(f"invalid {kind} URL: {e}") from None
    timeout = httpx.Timeout(policy.read_timeout, connect=policy.connect_timeout)
    deadline = policy.connect_timeout + policy.read_timeout  # total, against slow-drip servers
    try:
        async with (
            asyncio.timeout(deadline),
            httpx.AsyncClient(timeout=timeout, follow_redirects=False, trust_env=False) as client,
        ):
            for _ in range(policy.max_redirects + 1):
                got = await _fetch_one(client, current, policy, kind)
                if isinstance(got, bytes):
                    return got
                current = got
    except TimeoutError:
        raise _refuse(f"fetching the {kind} timed out after {deadline:g} s") from None
    except httpx.TimeoutException as e:
        raise _refuse(f"fetching the {kind} timed out: {type(e).__name__}") from None
    except httpx.InvalidURL as e:
        raise _refuse(f"invalid {kind} URL: {e}") from None
    except httpx.HTTPError as e:
        raise _refuse(f"fetching the {kind} failed: {type(e).__name__}: {e}") from None
    raise _refuse(f"{kind} URL redirected more than {policy.max_redirects} times")


async def load_url(url: str, policy: MediaPolicy) -> bytes:
    """An image given by URL, as checked bytes: a data: URI decoded, an http(s) URL fetched; other schemes refused."""
    if url[:5].lower() == "data:":
        return decode_data_uri(url, policy).data
    if url[:7].lower() == "http://" or url[:8].lower() == "https://":
        return (await fetch_image(url, policy)).data
    raise InvalidRequest("an image must be an http(s) URL or a data: URI (other schemes are refused)")


async def load_all(groups: list[list[tuple[str, Coroutine[Any, Any, bytes]]]], param: str) -> list[list[bytes]]:
    """Each group's images (where it is, the coroutine that loads it), loaded concurrently. The first refusal is a
    400 (`param`) naming where it is, and cancels the other loads."""

    async def one(where: str, load: Coroutine[Any, Any, bytes]) -> bytes:
        try:
            return await load
        except InvalidRequest as exc:
            raise InvalidRequest(f"{where}: {exc.message}", param=param) from None

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [[group.create_task(one(where, load)) for where, load in loads] for loads in groups]
    except* InvalidRequest as refused:
        raise refused.exceptions[0] from None
    return [[task.result() for task in loads] for loads in tasks]
