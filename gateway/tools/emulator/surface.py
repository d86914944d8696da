"""The emulator's rest of the OpenAI ``/v1`` surface (chat and Responses are ``gateway.tools.emulator.connection``'s):
enough for the demo and the passthrough's tests, with deterministic answers a test can check; anything else is a 404 in
OpenAI's envelope.

==================================  ===========================================================================
``POST /v1/embeddings``             a unit vector per input from its SHA-256 (``dimensions``, default 1536);
                                    ``encoding_format: base64``: little-endian float32, as OpenAI's
``POST /v1/completions``            legacy completions, whole or streamed (usage when asked), at the emulator's pace
``POST /v1/moderations``            nothing flagged, a result per input
``POST /v1/images/generations``     a tiny PNG per ``n``; gpt-image-1's usage, 272 output tokens an image (OpenAI's
                                    low-quality 1024x1024 figure)
``POST /v1/audio/transcriptions``   and ``/translations``: multipart; the text names the file's size and SHA-256
``POST /v1/audio/speech``           binary, chunked in several writes; ``[[emulate bytes=N]]`` sets its size
``/v1/files``, ``/v1/batches``      create, list, retrieve; a file's ``/content`` and delete; a batch's cancel
``GET /v1/models``                  the emulated models (:data:`MODELS`), and ``/v1/models/{id}``
==================================  ===========================================================================
"""

from __future__ import annotations

import base64
import hashlib
import math
import re
import struct
import time
from typing import Any, Protocol

import orjson

from gateway.tools.emulator.config import EmulatorConfig
from gateway.tools.emulator.directives import directives
from gateway.tools.emulator.schedule import Line, Schedule

MODELS = ("gpt-5.6-2026-10-01", "text-embedding-3-small", "text-embedding-3-large",
          "omni-moderation-latest", "whisper-1", "gpt-4o-mini-tts", "tts-1", "gpt-3.5-turbo-instruct")
# OpenAI's speech response formats and the content types its API answers them with
_AUDIO_TYPES = {"mp3": b"audio/mpeg", "opus": b"audio/ogg", "aac": b"audio/aac", "flac": b"audio/flac",
                "wav": b"audio/wav", "pcm": b"audio/pcm"}
# a 1x1 transparent PNG, base64
_PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAQAAAC1HAwCAAAAC0lEQVR42mNkYAAAAAYAAjCB0C8AAAAASUVORK5CYII="
_WORDS = ("Every", "token", "leaves", "the", "gateway", "the", "moment", "it", "arrives", ",", "unbuffered")
_CATEGORIES = ("harassment", "harassment/threatening", "hate", "hate/threatening", "illicit", "illicit/violent",
               "self-harm", "self-harm/instructions", "self-harm/intent", "sexual", "sexual/minors", "violence",
               "violence/graphic")


def vector(text: str, dimensions: int) -> list[float]:
    """A deterministic unit vector of ``dimensions`` floats for ``text`` (SHA-256 blocks as uniform numbers)."""
    raw = b""
    counter = 0
    while len(raw) < dimensions * 4:
        raw += hashlib.sha256(f"{counter}:{text}".encode()).digest()
        counter += 1
    values = [(v / 0xFFFFFFFF) * 2 - 1 for v in struct.unpack(f"<{dimensions}I", raw[:dimensions * 4])]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [float(struct.unpack("<f", struct.pack("<f", v / norm))[0]) for v in values]


def _tokens(text: str) -> int:
    return max(1, -(-len(text) // 4))


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> tuple[int, bytes]:
    return status, orjson.dumps({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                           "code": code}})


def multipart(body: bytes, content_type: str) -> dict[str, tuple[str | None, bytes]]:
    """The parts of a ``multipart/form-data`` body: field name -> (filename or None, bytes) (RFC 7578)."""
    found = re.search(r'boundary="?([^";]+)"?', content_type)
    if found is None:
        return {}
    out: dict[str, tuple[str | None, bytes]] = {}
    for part in body.split(b"--" + found[1].encode())[1:]:
        if part.startswith(b"--"):
            break
        head, _, data = part.partition(b"\r\n\r\n")
        name = re.search(rb'name="([^"]*)"', head)
        filename = re.search(rb'filename="([^"]*)"', head)
        if name is not None:
            out[name[1].decode()] = (filename[1].decode() if filename else None, data[:-2])  # the CRLF before --
    return out


class Replying(Line, Protocol):
    """What the surface answers through: the HTTP connection (``gateway.tools.emulator.connection``)."""

    @property
    def cfg(self) -> EmulatorConfig:
        """The emulator's defaults as they are now."""

    def reply(self, status: int, body: bytes, *, ctype: bytes = b"application/json",
              extra: list[tuple[bytes, bytes]] | None = None) -> None:
        """Answer with one whole body."""

    def start_chunked(self, status: int, ctype: bytes, extra: list[tuple[bytes, bytes]] | None = None) -> None:
        """Write the head of a chunked answer (its parts: :class:`Schedule`)."""


class Surface:

    def __init__(self) -> None:
        self.files: dict[str, dict[str, Any]] = {}
        self.contents: dict[str, bytes] = {}
        self.batches: dict[str, dict[str, Any]] = {}
        self.counter = 0

    def _id(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}-emu{self.counter:06d}"

    def handle(self, proto: Replying, method: str, path: str, headers: dict[bytes, bytes],
               body: bytes) -> bool:
        """False if the path is not this module's (``path``: under /v1, no query)."""
        if path == "completions" and method == "POST":
            self._completions(proto, body)
            return True
        if path == "audio/speech" and method == "POST":
            self._speech(proto, body)
            return True
        answer = self._answer(method, path, headers.get(b"content-type", b"").decode("latin-1"), body)
        if answer is None:
            return False
        status, data, *more = answer
        proto.reply(status, data, ctype=more[0] if more else b"application/json", extra=more[1] if more[1:] else None)
        return True

    def _answer(self, method: str, path: str, ctype: str, body: bytes) -> tuple[Any, ...] | None:
        parts = path.split("/")
        if method == "POST" and path == "embeddings":
            return self._embeddings(orjson.loads(body))
        if method == "POST" and path == "moderations":
            request = orjson.loads(body)
            inputs = request.get("input")
            results = [{"flagged": False, "categories": dict.fromkeys(_CATEGORIES, False),
                        "category_scores": dict.fromkeys(_CATEGORIES, 0.0001)}
                       for _ in (inputs if isinstance(inputs, list) else [inputs])]
            return 200, orjson.dumps({"id": self._id("modr"), "model": request.get("model", "omni-moderation-latest"),
                                      "results": results})
        if method == "POST" and path == "images/generations":
            request = orjson.loads(body)
            n = request.get("n") if isinstance(request.get("n"), int) else 1
            prompt = _tokens(str(request.get("prompt", "")))
            return 200, orjson.dumps({"created": int(time.time()), "data": [{"b64_json": _PNG}] * n, "usage": {
                "input_tokens": prompt, "output_tokens": 272 * n, "total_tokens": prompt + 272 * n,
                "input_tokens_details": {"text_tokens": prompt, "image_tokens": 0}}})
        if method == "POST" and path in ("audio/transcriptions", "audio/translations"):
            return self._transcription(multipart(body, ctype))
        if parts[0] == "files":
            return self._files(method, parts[1:], ctype, body)
        if parts[0] == "batches":
            return self._batches(method, parts[1:], body)
        if parts[0] == "models" and method == "GET":
            objects = [{"id": m, "object": "model", "created": 1764547200, "owned_by": "tiergate-emulator"}
                       for m in MODELS]
            if len(parts) == 1:
                return 200, orjson.dumps({"object": "list", "data": objects})
            wanted = "/".join(parts[1:])
            found = next((m for m in objects if m["id"] == wanted), None)
            if found is None:
                return _error(404, f"The model '{wanted}' does not exist", "model", "model_not_found")
            return 200, orjson.dumps(found)
        return None

    @staticmethod
    def _transcription(form: dict[str, tuple[str | None, bytes]]) -> tuple[Any, ...]:
        name, data = form.get("file", (None, b""))
        text = f"Emulated transcription of {name}: {len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()}."
        fmt = form.get("response_format", (None, b"json"))[1]
        if form.get("stream", (None, b"false"))[1] == b"true":
            events = [{"type": "transcript.text.delta", "delta": word + " "} for word in text.split(" ")]
            events.append({"type": "transcript.text.done", "text": text})
            return 200, b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events), b"text/event-stream"
        if fmt == b"text":
            return 200, text.encode(), b"text/plain; charset=utf-8"
        if fmt == b"verbose_json":
            return 200, orjson.dumps({"task": "transcribe", "language": "english", "duration": 1.0, "text": text,
                                      "segments": [{"id": 0, "seek": 0, "start": 0.0, "end": 1.0, "text": text,
                                                    "tokens": [], "temperature": 0.0, "avg_logprob": -0.1,
                                                    "compression_ratio": 1.0, "no_speech_prob": 0.0}]})
        return 200, orjson.dumps({"text": text, "usage": {"type": "duration", "seconds": 1}})

    def _embeddings(self, request: dict[str, Any]) -> tuple[int, bytes]:
        inputs = request.get("input")
        if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        if not isinstance(inputs, list) or not inputs:
            return _error(400, "'input' is required", "input")
        dimensions = request.get("dimensions", 1536)
        if not isinstance(dimensions, int) or not 1 <= dimensions <= 3072:
            return _error(400, "Invalid 'dimensions'", "dimensions")
        b64 = request.get("encoding_format") == "base64"
        data: list[dict[str, Any]] = []
        tokens = 0
        for i, item in enumerate(inputs):
            text = item if isinstance(item, str) else " ".join(map(str, item))
            tokens += _tokens(text) if isinstance(item, str) else len(item)
            values = vector(text, dimensions)
            embedding: Any = (base64.b64encode(struct.pack(f"<{dimensions}f", *values)).decode() if b64 else values)
            data.append({"object": "embedding", "index": i, "embedding": embedding})
        return 200, orjson.dumps({"object": "list", "data": data, "model": request.get("model"),
                                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    def _files(self, method: str, rest: list[str], ctype: str, body: bytes) -> tuple[Any, ...]:
        if not rest and method == "POST":
            form = multipart(body, ctype)
            name, data = form.get("file", (None, b""))
            purpose = form.get("purpose", (None, b"user_data"))[1].decode()
            fid = self._id("file")
            self.files[fid] = {"id": fid, "object": "file", "bytes": len(data), "created_at": int(time.time()),
                               "filename": name, "purpose": purpose, "status": "processed", "expires_at": None,
                               "status_details": None}
            self.contents[fid] = data if len(data) <= 8 * 1024 * 1024 else b""  # small ones kept for /content
            return 200, orjson.dumps(self.files[fid])
        if not rest and method == "GET":
            return 200, orjson.dumps({"object": "list", "data": list(self.files.values()), "has_more": False})
        fid = rest[0]
        if fid not in self.files:
            return _error(404, f"No such File object: {fid}", "id")
        if len(rest) == 2 and rest[1] == "content" and method == "GET":
            return 200, self.contents[fid], b"application/octet-stream", [
                (b"content-disposition", b'attachment; filename="%s"' % str(self.files[fid]["filename"]).encode())]
        if method == "DELETE":
            del self.files[fid]
            self.contents.pop(fid, None)
            return 200, orjson.dumps({"id": fid, "object": "file", "deleted": True})
        return 200, orjson.dumps(self.files[fid])

    def _batches(self, method: str, rest: list[str], body: bytes) -> tuple[Any, ...]:
        if not rest and method == "POST":
            request = orjson.loads(body)
            if request.get("input_file_id") not in self.files:
                return _error(400, f"Invalid 'input_file_id': {request.get('input_file_id')!r}.", "input_file_id")
            bid = self._id("batch")
            self.batches[bid] = {"id": bid, "object": "batch", "endpoint": request.get("endpoint"), "errors": None,
                                 "input_file_id": request["input_file_id"],
                                 "completion_window": request.get("completion_window", "24h"),
                                 "status": "validating", "output_file_id": None, "error_file_id": None,
                                 "created_at": int(time.time()), "request_counts": {"total": 0, "completed": 0,
                                                                                     "failed": 0},
                                 "metadata": request.get("metadata")}
            return 200, orjson.dumps(self.batches[bid])
        if not rest:
            return 200, orjson.dumps({"object": "list", "data": list(self.batches.values()), "has_more": False})
        batch = self.batches.get(rest[0])
        if batch is None:
            return _error(404, f"No batch found with id '{rest[0]}'.", "batch_id")
        if rest[1:] == ["cancel"] and method == "POST":
            batch["status"] = "cancelling"
        return 200, orjson.dumps(batch)

    def _completions(self, proto: Replying, body: bytes) -> None:
        """OpenAPI ``CreateCompletionResponse``, at the emulator's pace."""
        request = orjson.loads(body)
        d = directives(body)
        n = int(d.get("tokens", request.get("max_tokens") or 16))
        model = request.get("model", "gpt-3.5-turbo-instruct")
        prompt = request.get("prompt", "")
        asked = _tokens(str(prompt))
        usage = {"prompt_tokens": asked, "completion_tokens": n, "total_tokens": asked + n}
        words = [" " + _WORDS[i % len(_WORDS)] for i in range(n)]
        cid, created = self._id("cmpl"), int(time.time())
        finish = "length" if request.get("max_tokens") == n else "stop"

        def obj(text: str, reason: str | None, **more: Any) -> dict[str, Any]:
            return {"id": cid, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": reason}], **more}

        if request.get("stream") is not True:
            proto.reply(200, orjson.dumps(obj("".join(words), finish, usage=usage)))
            return
        tps = float(d.get("tps", proto.cfg.tps))
        t0 = proto.loop.time() + float(d.get("ttft_ms", proto.cfg.ttft * 1000)) / 1000
        events = [b"data: " + orjson.dumps(obj(w, finish if i == n - 1 else None)) + b"\n\n"
                  for i, w in enumerate(words)]
        options = request.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            tail = obj("", None, usage=usage)
            tail["choices"] = []
            events.append(b"data: " + orjson.dumps(tail) + b"\n\n")
        events.append(b"data: [DONE]\n\n")
        proto.start_chunked(200, b"text/event-stream; charset=utf-8")
        Schedule(proto, [(t0 + i / tps, e) for i, e in enumerate(events)], d).start()

    def _speech(self, proto: Replying, body: bytes) -> None:
        request = orjson.loads(body)
        size = int(directives(body).get("bytes", 64 * 1024))
        seed = hashlib.sha256(str(request.get("input", "")).encode()).digest()
        audio = (b"ID3" + seed * (size // len(seed) + 1))[:size]
        step = 16 * 1024
        t0 = proto.loop.time()
        proto.start_chunked(200, _AUDIO_TYPES.get(str(request.get("response_format", "mp3")), b"audio/mpeg"))
        Schedule(proto, [(t0 + 0.005 * i, audio[at:at + step]) for i, at in enumerate(range(0, size, step))], {},
                 coalesce=False).start()
