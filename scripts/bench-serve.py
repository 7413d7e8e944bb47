#!/usr/bin/env python3
"""Serving benchmark for any OpenAI-compatible HTTP server: `infer serve`, llama.cpp's
`llama-server`, vLLM, ... Python 3 standard library only.

What it measures. For each concurrency level C (--concurrency 1,4,8,16), N requests (--requests,
default max(C, 8)) go to /v1/chat/completions (or /v1/completions with --endpoint completions)
from C client threads at once, each thread taking the next prompt from a shared queue, so at most
C requests are in flight. Every request streams (`"stream": true` with
`"stream_options": {"include_usage": true}`), is greedy (temperature 0) unless --temperature says
otherwise, and asks for --max-tokens tokens. Per request the client records, on its own clock
(time.perf_counter, from just before it connects):

  TTFT    time to the first SSE chunk that carries non-empty generated text
          (choices[0].delta.content, or .reasoning_content / .reasoning, for chat;
          choices[0].text for completions); role-only and empty chunks do not count
  ITL     the gaps between successive chunks that carry text. Each such SSE chunk is taken to be
          ONE token: a server that sends several tokens in one chunk shows a longer gap followed
          by none, so ITL is per chunk, not strictly per token. TPOT (time per output token,
          (total - TTFT) / (tokens - 1) per request) does not depend on that and is reported too
  tokens  completion_tokens from the final usage chunk when the server sends one, else the
          number of text-carrying chunks
  total   time to the end of the stream

and per level: requests/s (successful requests / wall time of the level), output tokens/s
(total completion tokens of the successful requests / wall time of the level: the aggregate
throughput), TTFT p50/p99 over the level's requests, ITL p50/p99 over all gaps of all its
requests, TPOT p50, and the number of failed requests (HTTP error, error event in the stream,
broken connection, timeout). With --rounds R every level runs R times (all levels in turn, R
times over); its percentiles pool the samples of all rounds and its rates are the totals of all
rounds over their summed wall times (--json lists each round's too).

Prompts: a fixed built-in set of 16 short coding / explanation questions, or --prompts FILE.jsonl
({"prompt": "..."} per line), used in order and round-robin. Each prompt is sent with a unique
leading tag ("[bench 3f9a-17] ...") so that a server's prefix cache (llama-server's cache_prompt,
infer's shared blocks) cannot reuse an earlier request's prompt; --exact-prompts sends them
verbatim. One warm-up request (--warmup) runs before the first level and is not counted.

Output: a markdown table on stdout, one row per level, or with --json one JSON object; progress
and diagnostics go to stderr. Exits 1 with a `bench-serve: ...` message if the server cannot be
reached, the warm-up request fails or every request fails; Ctrl-C stops the run, closes the open
connections (so the server cancels them) and prints the levels finished so far (exit 130).

Examples:

  # our server
  infer serve -m models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --parallel 8 &
  scripts/bench-serve.py --url http://127.0.0.1:8080 --concurrency 1,4,8 --max-tokens 128

  # llama.cpp's server (same model, same slots)
  llama-server --model models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --host 127.0.0.1 \\
      --port 18080 --parallel 8 -c 8192 --no-webui &
  scripts/bench-serve.py --url http://127.0.0.1:18080 --concurrency 1,4,8 --max-tokens 128

  # a model without a chat template (Gemma-3-270M's GGUF): the plain completions endpoint
  scripts/bench-serve.py --url http://127.0.0.1:18080 --endpoint completions --json > out.json
"""

import argparse
import http.client
import json
import os
import queue
import socket
import ssl
import statistics
import sys
import threading
import time
import urllib.parse

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation.",
    "Explain the difference between a process and a thread in a few sentences.",
    "What does the `?` operator do in Rust? Give a short example.",
    "Write a SQL query that returns the five customers with the highest total order amount.",
    "Explain what a hash table is and why lookups are O(1) on average.",
    "Write a bash one-liner that counts the lines of all .py files under the current directory.",
    "What is the difference between `git merge` and `git rebase`?",
    "Implement binary search in C and explain its time complexity.",
    "Explain what a race condition is and how a mutex prevents it.",
    "Write a JavaScript function that debounces another function.",
    "What is the difference between TCP and UDP? When would you use each?",
    "Write a Go function that reverses a slice of integers in place.",
    "Explain big-O notation to a beginner with two examples.",
    "Write a regular expression that matches a valid IPv4 address and explain it.",
    "What are Python decorators? Show a decorator that times a function call.",
    "Explain how garbage collection differs from reference counting.",
]

TABLE_COLUMNS = [
    ("concurrency", "concurrency"),
    ("requests", "requests"),
    ("errors", "errors"),
    ("wall s", "wall_s"),
    ("req/s", "requests_per_s"),
    ("out tok/s", "output_tokens_per_s"),
    ("TTFT p50 ms", ("ttft_ms", "p50")),
    ("TTFT p99 ms", ("ttft_ms", "p99")),
    ("ITL p50 ms", ("itl_ms", "p50")),
    ("ITL p99 ms", ("itl_ms", "p99")),
    ("TPOT p50 ms", ("tpot_ms", "p50")),
]


class Fatal(Exception):
    """An error that ends the run with `bench-serve: MESSAGE` and exit status 1."""


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def percentile(values, p):
    """Linear interpolation between closest ranks (numpy's default, Excel's PERCENTILE.INC):
    rank = p/100 * (n-1) over the sorted values. None for no values."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summary_ms(values):
    """p50/p99/mean in milliseconds of values in seconds (None where there are none)."""
    if not values:
        return {"p50": None, "p99": None, "mean": None, "n": 0}
    return {
        "p50": percentile(values, 50) * 1e3,
        "p99": percentile(values, 99) * 1e3,
        "mean": statistics.fmean(values) * 1e3,
        "n": len(values),
    }


class Target:
    """The base URL split into what http.client needs, plus the request headers."""

    def __init__(self, url, api_key, timeout):
        if "://" not in url:
            url = "http://" + url
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise Fatal(f"bad --url {url!r}: expected http(s)://HOST[:PORT][/PREFIX]")
        self.url = url
        self.https = u.scheme == "https"
        self.host = u.hostname
        self.port = u.port or (443 if self.https else 80)
        prefix = u.path.rstrip("/")
        if prefix.endswith("/v1"):
            prefix = prefix[:-3]
        self.prefix = prefix
        self.timeout = timeout
        self.headers = {"Accept": "text/event-stream, application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def connect(self):
        if self.https:
            return http.client.HTTPSConnection(
                self.host, self.port, timeout=self.timeout, context=ssl.create_default_context()
            )
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def path(self, tail):
        return f"{self.prefix}/v1/{tail}"


def error_text(body, limit=300):
    """The message of an OpenAI-style error body ({"error": {"message": ...}}), else the body."""
    text = body.decode("utf-8", "replace").strip() if isinstance(body, bytes) else str(body)
    try:
        obj = json.loads(text)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        if isinstance(err, dict) and "message" in err:
            text = str(err["message"])
        elif isinstance(err, str):
            text = err
    except ValueError:
        pass
    text = " ".join(text.split())
    return text[:limit] + ("..." if len(text) > limit else "")


def fetch_models(target):
    """GET /v1/models: the model ids. Raises Fatal when the server cannot be reached at all and
    RuntimeError for an HTTP error (the server is there but has no usable list)."""
    conn = target.connect()
    try:
        conn.request("GET", target.path("models"), headers=target.headers)
        resp = conn.getresponse()
        body = resp.read()
    except (OSError, http.client.HTTPException) as e:
        raise Fatal(f"cannot reach {target.url}: {e}") from None
    finally:
        conn.close()
    if resp.status != 200:
        hint = " (wrong or missing --api-key?)" if resp.status in (401, 403) else ""
        raise RuntimeError(f"GET {target.path('models')}: HTTP {resp.status}{hint}: {error_text(body)}")
    try:
        data = json.loads(body).get("data") or []
        return [m["id"] for m in data if isinstance(m, dict) and "id" in m]
    except (ValueError, AttributeError):
        raise RuntimeError(f"GET {target.path('models')}: not an OpenAI model list: {error_text(body)}")


class SSEParser:
    """Splits a byte stream into SSE events. Calls on_data(payload) for each `data:` payload that
    is complete JSON (or `[DONE]`) as soon as its line arrives; data lines that only parse together
    (multi-line events) are joined with newlines and handed over at the blank line ending the event,
    as the SSE spec says. Comment lines (`:` keepalives/pings), `id:`/`retry:` fields and blank
    lines are skipped; `event: error` marks the next data as an error."""

    def __init__(self, on_data):
        self.on_data = on_data
        self.buf = b""
        self.pending = []
        self.event = None

    def feed(self, chunk, now):
        self.buf += chunk
        while True:
            i = self.buf.find(b"\n")
            if i < 0:
                return
            line = self.buf[:i].rstrip(b"\r")
            self.buf = self.buf[i + 1 :]
            self.line(line.decode("utf-8", "replace"), now)

    def finish(self, now):
        if self.buf:
            self.line(self.buf.rstrip(b"\r").decode("utf-8", "replace"), now)
            self.buf = b""
        self.line("", now)

    def line(self, line, now):
        if not line:
            if self.pending:
                data, self.pending = "\n".join(self.pending), []
                self.on_data(data, self.event, now)
            self.event = None
            return
        if line.startswith(":"):
            return
        field, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if field == "data":
            if not self.pending:
                stripped = value.strip()
                if stripped == "[DONE]" or _is_json(stripped):
                    self.on_data(stripped, self.event, now)
                    return
            self.pending.append(value)
        elif field == "event":
            self.event = value.strip()
        elif field == "error":
            # not standard SSE, but some servers have sent `error: {...}` lines
            self.on_data(json.dumps({"error": error_text(value)}), "error", now)


def _is_json(text):
    if not text or text[0] not in "{[":
        return False
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def chunk_text(obj):
    """The generated text a stream chunk carries ('' for role-only, finish and usage chunks)."""
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return ""
    choice = choices[0]
    parts = []
    delta = choice.get("delta")
    if isinstance(delta, dict):
        for key in ("content", "reasoning_content", "reasoning"):
            v = delta.get(key)
            if isinstance(v, str) and v:
                parts.append(v)
    v = choice.get("text")
    if isinstance(v, str) and v:
        parts.append(v)
    return "".join(parts)


class Bench:
    def __init__(self, args, target, model, prompts):
        self.args = args
        self.target = target
        self.model = model
        self.prompts = prompts
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.active = set()  # open connections, closed on Ctrl-C
        self.counter = 0
        self.run_tag = os.urandom(2).hex()

    def body(self, prompt):
        a = self.args
        if not a.exact_prompts:
            with self.lock:
                self.counter += 1
                n = self.counter
            prompt = f"[bench {self.run_tag}-{n}] {prompt}"
        body = {
            "model": self.model,
            "max_tokens": a.max_tokens,
            "temperature": a.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if a.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if a.ignore_eos:
            body["ignore_eos"] = True
        body.update(a.extra_body)
        return json.dumps(body).encode()

    def request(self, prompt):
        """One streamed request. Returns a dict: ok, error, ttft, itls, total, tokens, chunks,
        usage (whether tokens came from the usage chunk), finish_reason."""
        r = {"ok": False, "error": None, "ttft": None, "itls": [], "total": None, "tokens": 0,
             "chunks": 0, "usage": False, "finish_reason": None, "prompt_tokens": None}
        path = self.target.path("chat/completions" if self.args.endpoint == "chat" else "completions")
        payload = self.body(prompt)
        headers = dict(self.target.headers, **{"Content-Type": "application/json"})
        state = {"last": None, "done": False, "error": None}
        t0 = time.perf_counter()

        def on_data(data, event, now):
            if state["done"] or state["error"]:
                return
            if data == "[DONE]":
                state["done"] = True
                return
            try:
                obj = json.loads(data)
            except ValueError:
                state["error"] = f"unparseable SSE data: {data[:120]!r}"
                return
            if not isinstance(obj, dict):
                return
            if event == "error" or obj.get("error"):
                state["error"] = "error in stream: " + error_text(json.dumps(obj))
                return
            if chunk_text(obj):
                r["chunks"] += 1
                if state["last"] is None:
                    r["ttft"] = now - t0
                else:
                    r["itls"].append(now - state["last"])
                state["last"] = now
            choices = obj.get("choices")
            if isinstance(choices, list) and choices and isinstance(choices[0], dict):
                fr = choices[0].get("finish_reason")
                if fr:
                    r["finish_reason"] = fr
            usage = obj.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                r["tokens"] = usage["completion_tokens"]
                r["usage"] = True
                if isinstance(usage.get("prompt_tokens"), int):
                    r["prompt_tokens"] = usage["prompt_tokens"]

        conn = self.target.connect()
        with self.lock:
            self.active.add(conn)
        try:
            conn.request("POST", path, body=payload, headers=headers)
            resp = conn.getresponse()
            if resp.status != 200:
                hint = " (wrong or missing --api-key?)" if resp.status in (401, 403) else ""
                r["error"] = f"HTTP {resp.status}{hint}: {error_text(resp.read())}"
                return r
            parser = SSEParser(on_data)
            while not state["done"] and not state["error"]:
                chunk = resp.read1(65536)
                now = time.perf_counter()
                if not chunk:
                    parser.finish(now)
                    break
                parser.feed(chunk, now)
            r["total"] = time.perf_counter() - t0
            if state["error"]:
                r["error"] = state["error"]
            elif not state["done"] and r["finish_reason"] is None:
                r["error"] = "stream ended without [DONE] or a finish_reason"
            else:
                r["ok"] = True
                if not r["usage"]:
                    r["tokens"] = r["chunks"]
        except (OSError, http.client.HTTPException) as e:
            r["error"] = "interrupted" if self.stop.is_set() else f"{type(e).__name__}: {e}"
        finally:
            with self.lock:
                self.active.discard(conn)
            conn.close()
        return r

    def abort(self):
        """Ctrl-C: stop handing out prompts and close every open connection."""
        self.stop.set()
        with self.lock:
            conns = list(self.active)
        for conn in conns:
            try:
                if conn.sock is not None:
                    conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def run_level(self, concurrency, n_requests, label):
        """n_requests requests from `concurrency` threads; returns (results, wall seconds)."""
        work = queue.Queue()
        for i in range(n_requests):
            work.put(self.prompts[i % len(self.prompts)])
        results = []
        progress = {"done": 0, "errors": 0}
        tty = sys.stderr.isatty()

        def worker():
            while not self.stop.is_set():
                try:
                    prompt = work.get_nowait()
                except queue.Empty:
                    return
                res = self.request(prompt)
                with self.lock:
                    results.append(res)
                    progress["done"] += 1
                    if not res["ok"]:
                        progress["errors"] += 1
                        if not self.stop.is_set() and progress["errors"] <= 3:
                            more = " (further failures: in the summary)" if progress["errors"] == 3 else ""
                            log(f"bench-serve: {label}: request failed: {res['error']}{more}")
                    if tty:
                        sys.stderr.write(f"\r{label}: {progress['done']}/{n_requests} done, "
                                         f"{progress['errors']} errors ")
                        sys.stderr.flush()

        threads = [threading.Thread(target=worker, daemon=True)
                   for _ in range(max(1, min(concurrency, n_requests)))]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.2)  # a timed join lets KeyboardInterrupt reach the main thread
        wall = time.perf_counter() - t0
        if tty:
            sys.stderr.write("\n")
        return results, wall


def level_stats(concurrency, rounds):
    """Figures of one level from [(results, wall)] of its rounds."""
    results = [r for rs, _ in rounds for r in rs]
    ok = [r for r in results if r["ok"]]
    wall = sum(w for _, w in rounds)
    tokens = sum(r["tokens"] for r in ok)
    ttfts = [r["ttft"] for r in ok if r["ttft"] is not None]
    itls = [g for r in ok for g in r["itls"]]
    tpots = [(r["total"] - r["ttft"]) / (r["tokens"] - 1)
             for r in ok if r["ttft"] is not None and r["tokens"] > 1]
    per_round = []
    for rs, w in rounds:
        rok = [r for r in rs if r["ok"]]
        rtok = sum(r["tokens"] for r in rok)
        per_round.append({
            "requests": len(rs), "errors": len(rs) - len(rok), "wall_s": w,
            "requests_per_s": len(rok) / w if w > 0 else None,
            "output_tokens": rtok,
            "output_tokens_per_s": rtok / w if w > 0 else None,
        })
    errors = {}
    for r in results:
        if not r["ok"]:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "ok": len(ok),
        "errors": len(results) - len(ok),
        "wall_s": wall,
        "requests_per_s": len(ok) / wall if wall > 0 else None,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall if wall > 0 else None,
        "mean_output_tokens": tokens / len(ok) if ok else None,
        "content_chunks": sum(r["chunks"] for r in ok),
        "tokens_from_usage": sum(1 for r in ok if r["usage"]),
        "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in ok),
        "no_text": sum(1 for r in ok if r["ttft"] is None),
        "ttft_ms": summary_ms(ttfts),
        "itl_ms": summary_ms(itls),
        "tpot_ms": summary_ms(tpots),
        "total_ms": summary_ms([r["total"] for r in ok]),
        "rounds": per_round,
        "error_messages": errors,
    }


def fmt(v, key):
    if v is None:
        return "-"
    if isinstance(v, int):
        return str(v)
    if key == "requests_per_s":
        return f"{v:.2f}"
    if key == "wall_s":
        return f"{v:.2f}"
    return f"{v:.1f}"


def markdown(levels):
    head = [name for name, _ in TABLE_COLUMNS]
    rows = []
    for lv in levels:
        row = []
        for _, key in TABLE_COLUMNS:
            v = lv[key[0]][key[1]] if isinstance(key, tuple) else lv[key]
            row.append(fmt(v, key))
        rows.append(row)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    out = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |",
           "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"]
    for r in rows:
        out.append("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |")
    return "\n".join(out)


def read_prompts(path):
    prompts = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    raise Fatal(f"{path}:{n}: not JSON: {e}") from None
                if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                    raise Fatal(f'{path}:{n}: expected {{"prompt": "..."}}')
                prompts.append(obj["prompt"])
    except OSError as e:
        raise Fatal(f"cannot read --prompts {path}: {e}") from None
    if not prompts:
        raise Fatal(f"{path}: no prompts")
    return prompts


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="bench-serve.py",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serving benchmark for an OpenAI-compatible server: streamed requests at\n"
                    "several concurrency levels; requests/s, output tokens/s, TTFT, ITL, TPOT.",
        epilog="Timing: TTFT is the time to the first SSE chunk with non-empty text; ITL the gaps\n"
               "between successive text chunks (each chunk counts as one token); TPOT is\n"
               "(total - TTFT) / (completion tokens - 1) per request. Token counts come from the\n"
               "final usage chunk's completion_tokens when present, else the number of text chunks.\n"
               "Percentiles: linear interpolation between closest ranks (numpy's default),\n"
               "rank = p/100 * (n - 1). ITL percentiles pool all gaps of all requests of a level.\n"
               "Each prompt gets a unique leading tag to defeat prefix caches (--exact-prompts\n"
               "turns that off). See the docstring at the top of this file for examples.")
    p.add_argument("--url", required=True,
                   help="server base URL, e.g. http://127.0.0.1:8080 (a trailing /v1 is accepted)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--model", help="model name to request (default: the first id of GET /v1/models)")
    p.add_argument("--concurrency", default="1,4,8,16",
                   help="comma-separated concurrency levels (default 1,4,8,16)")
    p.add_argument("--requests", type=int,
                   help="requests per level and round (default: max(concurrency, 8))")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens per request (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                   help="/v1/chat/completions (default) or /v1/completions")
    p.add_argument("--prompts", metavar="FILE.jsonl",
                   help='prompts, one {"prompt": "..."} per line (default: 16 built-in ones)')
    p.add_argument("--rounds", type=int, default=1,
                   help="run every level this many times; percentiles pool all rounds, rates are "
                        "total / summed wall time (default 1)")
    p.add_argument("--warmup", type=int, default=1,
                   help="unmeasured requests before the first level (default 1)")
    p.add_argument("--exact-prompts", action="store_true",
                   help="send prompts verbatim, without the unique tag that defeats prefix caching")
    p.add_argument("--ignore-eos", action="store_true",
                   help='add "ignore_eos": true (llama-server/vLLM extension: always max_tokens tokens)')
    p.add_argument("--extra-body", metavar="JSON", default="{}",
                   help='extra fields merged into every request body, e.g. \'{"top_k": 1}\'')
    p.add_argument("--timeout", type=float, default=600.0,
                   help="socket timeout per request in seconds (default 600)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    a = p.parse_args(argv)
    try:
        a.levels = [int(x) for x in a.concurrency.split(",") if x.strip()]
    except ValueError:
        p.error(f"--concurrency: expected comma-separated integers, got {a.concurrency!r}")
    if not a.levels or any(c < 1 for c in a.levels):
        p.error("--concurrency: levels must be >= 1")
    if a.requests is not None and a.requests < 1:
        p.error("--requests must be >= 1")
    if a.rounds < 1:
        p.error("--rounds must be >= 1")
    if a.max_tokens < 1:
        p.error("--max-tokens must be >= 1")
    if a.warmup < 0:
        p.error("--warmup must be >= 0")
    try:
        a.extra_body = json.loads(a.extra_body)
    except ValueError as e:
        p.error(f"--extra-body: not JSON: {e}")
    if not isinstance(a.extra_body, dict):
        p.error("--extra-body must be a JSON object")
    return a


def main(argv):
    a = parse_args(argv)
    prompts = read_prompts(a.prompts) if a.prompts else PROMPTS
    target = Target(a.url, a.api_key, a.timeout)

    # Reachability check and the model name.
    try:
        models = fetch_models(target)
    except RuntimeError as e:
        if not a.model:
            raise Fatal(f"{e}; pass --model") from None
        log(f"bench-serve: note: {e}")
        models = []
    model = a.model
    if not model:
        if not models:
            raise Fatal(f"GET {target.path('models')} lists no models; pass --model")
        model = models[0]
    log(f"bench-serve: {target.url} model={model} endpoint={a.endpoint} max_tokens={a.max_tokens} "
        f"temperature={a.temperature} prompts={len(prompts)} levels={a.levels} rounds={a.rounds}")

    bench = Bench(a, target, model, prompts)
    done_levels = []
    rounds = {c: [] for c in a.levels}
    interrupted = False
    try:
        for i in range(a.warmup):
            r = bench.request(prompts[i % len(prompts)])
            if not r["ok"]:
                raise Fatal(f"warm-up request failed: {r['error']}")
            log(f"bench-serve: warm-up {i + 1}/{a.warmup}: {r['tokens']} tokens in {r['total']:.2f} s")
        for rnd in range(a.rounds):
            for c in a.levels:
                n = a.requests if a.requests is not None else max(c, 8)
                label = f"concurrency {c}" + (f" round {rnd + 1}/{a.rounds}" if a.rounds > 1 else "")
                log(f"bench-serve: {label}: {n} requests")
                res, wall = bench.run_level(c, n, label)
                if bench.stop.is_set():
                    break
                rounds[c].append((res, wall))
                ok = sum(1 for r in res if r["ok"])
                toks = sum(r["tokens"] for r in res if r["ok"])
                log(f"bench-serve: {label}: {ok}/{n} ok in {wall:.2f} s, {toks} tokens "
                    f"({toks / wall if wall > 0 else 0:.1f} tok/s)")
            if bench.stop.is_set():
                break
    except KeyboardInterrupt:
        interrupted = True
        bench.abort()
        log("\nbench-serve: interrupted; closing connections")
        # give workers a moment to notice their closed sockets and exit
        deadline = time.monotonic() + 2.0
        for t in threading.enumerate():
            if t is not threading.current_thread() and t.daemon:
                t.join(max(0.0, deadline - time.monotonic()))

    for c in a.levels:
        if rounds[c]:
            done_levels.append(level_stats(c, rounds[c]))

    total = sum(lv["requests"] for lv in done_levels)
    total_ok = sum(lv["ok"] for lv in done_levels)
    for lv in done_levels:
        for msg, n in lv["error_messages"].items():
            log(f"bench-serve: concurrency {lv['concurrency']}: {n} x {msg}")
        if lv["no_text"]:
            log(f"bench-serve: concurrency {lv['concurrency']}: {lv['no_text']} requests produced no text")
        if lv["ok"] and lv["tokens_from_usage"] < lv["ok"]:
            log(f"bench-serve: concurrency {lv['concurrency']}: {lv['ok'] - lv['tokens_from_usage']} "
                "requests had no usage chunk; their tokens are counted as text chunks")
    if total and not total_ok:
        first = next(iter(done_levels[0]["error_messages"]), "unknown error")
        raise Fatal(f"all {total} requests failed (first error: {first})")

    if done_levels:
        if a.json:
            out = {
                "url": target.url, "endpoint": a.endpoint, "model": model,
                "max_tokens": a.max_tokens, "temperature": a.temperature,
                "prompts": len(prompts), "exact_prompts": a.exact_prompts,
                "rounds": a.rounds, "warmup": a.warmup,
                "percentiles": "linear interpolation, rank = p/100*(n-1)",
                "itl_unit": "one SSE chunk with text = one token",
                "interrupted": interrupted,
                "levels": done_levels,
            }
            print(json.dumps(out, indent=2))
        else:
            print(markdown(done_levels))
    sys.stdout.flush()
    return 130 if interrupted else 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except Fatal as e:
        log(f"bench-serve: {e}")
        sys.exit(1)
    except KeyboardInterrupt:
        log("\nbench-serve: interrupted")
        sys.exit(130)
    except BrokenPipeError:
        # stdout closed early (e.g. piped into head): no second error at interpreter exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
