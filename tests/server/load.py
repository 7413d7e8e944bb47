#!/usr/bin/env python3
"""Load and fault test for `infer serve`: 32 concurrent clients against a server whose KV pool
cannot hold them all (it must preempt and recompute). A third of the clients disconnect at
random points (before their first token, mid-stream, mid-answer without streaming), some send
malformed bodies first. Every request that completes must equal its solo greedy output
(`--expect`: {"prompts", "texts", "max_tokens"}, from `infer run` alone); afterwards the server
must be up and idle: no running sequence, no KV block in use, nothing in flight.

  python3 tests/server/load.py --url http://127.0.0.1:8080 --expect expect.json

Standard library only. Prints a summary; exits 0 when every check passes, else 1.
"""
import argparse, http.client, json, random, socket, sys, threading, time
from urllib.parse import urlparse


def metrics(host, port):
    c = http.client.HTTPConnection(host, port, timeout=30)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def post(host, port, path, body, timeout=600):
    c = http.client.HTTPConnection(host, port, timeout=timeout)
    c.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def stream_text(resp):
    """The text of a completions SSE stream and whether it ended with [DONE]."""
    parts, done = [], False
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        payload = line[6:]
        if payload == "[DONE]":
            done = True
            break
        obj = json.loads(payload)
        if "error" in obj:
            raise RuntimeError(obj["error"])
        for ch in obj.get("choices", []):
            parts.append(ch.get("text") or "")
    return "".join(parts), done


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--expect", required=True)
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    exp = json.load(open(a.expect))
    u = urlparse(a.url)
    host, port = u.hostname, u.port
    prompts, texts, max_tokens = exp["prompts"], exp["texts"], exp["max_tokens"]
    rng = random.Random(a.seed)
    plans = []
    for i in range(len(prompts)):
        kind = "leave" if i % 3 == 0 else ("stream" if i % 2 else "plain")
        plans.append({"i": i, "kind": kind, "malformed": i % 5 == 1, "after": rng.randint(0, 8)})
    results, errors, lock = {}, [], threading.Lock()

    def client(p):
        i = p["i"]
        body = json.dumps({"prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0,
                           "stream": p["kind"] != "plain"})
        try:
            if p["malformed"]:
                st, data = post(host, port, "/v1/completions", body[: len(body) // 2])
                if st != 400 or "error" not in json.loads(data):
                    raise RuntimeError(f"malformed body answered {st}: {data[:200]!r}")
            if p["kind"] == "plain":
                st, data = post(host, port, "/v1/completions", body)
                if st != 200:
                    raise RuntimeError(f"status {st}: {data[:300]!r}")
                text = json.loads(data)["choices"][0]["text"]
                with lock:
                    results[i] = text
            elif p["kind"] == "stream":
                c = http.client.HTTPConnection(host, port, timeout=600)
                c.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
                r = c.getresponse()
                if r.status != 200:
                    raise RuntimeError(f"status {r.status}: {r.read()[:300]!r}")
                text, done = stream_text(r)
                c.close()
                if not done:
                    raise RuntimeError("stream ended without [DONE]")
                with lock:
                    results[i] = text
            else:
                # Leave after `after` SSE events (0: right after sending the request).
                s = socket.create_connection((host, port), timeout=600)
                s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                           f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
                seen = 0
                while seen < p["after"]:
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    seen += chunk.count(b"data: ")
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                s.close()
        except Exception as e:  # noqa: BLE001 - every failure is reported
            with lock:
                errors.append(f"client {i} ({p['kind']}): {e}")

    t0 = time.time()
    threads = [threading.Thread(target=client, args=(p,)) for p in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    secs = time.time() - t0

    failures = list(errors)
    completed = [p["i"] for p in plans if p["kind"] != "leave"]
    for i in completed:
        if i in results and results[i] != texts[i]:
            failures.append(f"request {i}: {results[i]!r} != solo {texts[i]!r}")
        if i not in results and not any(f"client {i} " in e for e in errors):
            failures.append(f"request {i}: no result")
    # Idle within a few steps: cancelled requests end at the next step.
    deadline, m = time.time() + 30, {}
    while time.time() < deadline:
        m = metrics(host, port)
        if m.get("infer_running_sequences") == 0 and m.get("infer_kv_blocks_used") == 0 \
                and m.get("infer_requests_in_flight") == 0 and m.get("infer_queue_length") == 0:
            break
        time.sleep(0.2)
    for k in ("infer_running_sequences", "infer_kv_blocks_used", "infer_requests_in_flight", "infer_queue_length"):
        if m.get(k) != 0:
            failures.append(f"{k} = {m.get(k)} at the end")
    if not m.get("infer_preemptions_total", 0) > 0:
        failures.append("no preemption: the KV pool was not under pressure")
    c = http.client.HTTPConnection(host, port, timeout=30)
    c.request("GET", "/health")
    if c.getresponse().status != 200:
        failures.append("/health is not 200 after the load")
    n400 = m.get('infer_requests_total{endpoint="completions",status="400"}', 0)
    n_malformed = sum(p["malformed"] for p in plans)
    if n400 != n_malformed:
        failures.append(f"{n400} 400s counted, {n_malformed} malformed bodies sent")
    summary = {"clients": len(plans), "completed_equal_solo": sum(1 for i in completed if results.get(i) == texts[i]),
               "left": sum(p["kind"] == "leave" for p in plans), "malformed": n_malformed,
               "preemptions": m.get("infer_preemptions_total"), "seconds": round(secs, 1), "failures": failures}
    print(json.dumps(summary))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
