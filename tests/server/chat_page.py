#!/usr/bin/env python3
"""End-to-end test of the chat page served by `infer serve` (src/server/page.html).

Opens the page in headless Chromium, types a message with real input events (Chrome DevTools
Protocol), clicks Send, watches the answer stream in, and checks the DOM: user bubble holds the
message, assistant bubble is non-empty and grew in several steps, no .error, stats say "tokens/s".
Prints one line of JSON; exits 0 on success, 1 on failure. Only the standard library is used
(a minimal websocket client is below).

  python3 tests/server/chat_page.py --url http://127.0.0.1:8080
  python3 tests/server/chat_page.py --url http://127.0.0.1:18181 \
      --page-url "file:///work/main/src/server/page.html?api=http://127.0.0.1:18181" --screenshot /tmp/chat.png
"""
import argparse, base64, json, os, shutil, signal, socket, struct, subprocess, sys, tempfile, time, urllib.request
from urllib.parse import urlparse


class WebSocket:
    """Just enough of RFC 6455 for CDP: client text frames out, unfragmented or fragmented frames in."""

    def __init__(self, url, timeout):
        u = urlparse(url)
        self.sock = socket.create_connection((u.hostname, u.port), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {u.path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(1)
            if not chunk:
                raise ConnectionError("websocket handshake: connection closed")
            head += chunk
        if b" 101 " not in head.split(b"\r\n")[0]:
            raise ConnectionError(f"websocket handshake failed: {head[:200]!r}")

    def _exact(self, n):
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("websocket closed")
            buf += chunk
        return buf

    def send(self, text):
        data, mask = text.encode(), os.urandom(4)
        n = len(data)
        head = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else
                                struct.pack("!BH", 0x80 | 126, n) if n < 65536 else struct.pack("!BQ", 0x80 | 127, n))
        self.sock.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))

    def recv(self):
        message = b""
        while True:
            b0, b1 = self._exact(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack("!H", self._exact(2))[0]
            elif n == 127:
                n = struct.unpack("!Q", self._exact(8))[0]
            payload = self._exact(n)  # server frames are never masked
            opcode = b0 & 0x0F
            if opcode == 8:
                raise ConnectionError("websocket closed by peer")
            if opcode in (9, 10):  # ping/pong: CDP does not use them; ignore
                continue
            message += payload
            if b0 & 0x80:
                return message.decode()

    def close(self):
        self.sock.close()


class CDP:
    def __init__(self, ws_url, timeout):
        self.ws, self.next_id = WebSocket(ws_url, timeout), 0

    def call(self, method, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:  # skip events until our answer arrives
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def js(self, expr):
        r = self.call("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"JS error in {expr[:80]!r}: {r['exceptionDetails']}")
        return r["result"].get("value")


STATE_JS = """JSON.stringify((() => {
  const a = [...document.querySelectorAll('#messages .msg.assistant')].pop();
  const u = [...document.querySelectorAll('#messages .msg.user')].pop();
  const s = a && a.querySelector('.stats');
  return {assistant: a ? (a.querySelector('.text') || a).textContent : null, done: !!a && a.dataset.done === '1',
          user: u ? u.textContent : null, stats: s ? s.textContent : null,
          errors: [...document.querySelectorAll('.error')].map(e => e.textContent)};
})())"""


def run(args, tmp):
    proc = subprocess.Popen(["/usr/bin/chromium", "--headless=new", "--no-sandbox", "--disable-gpu",
                             "--remote-debugging-port=0", f"--user-data-dir={tmp}", "--window-size=1000,800",
                             "--no-first-run", "--no-default-browser-check", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        port_file, deadline = os.path.join(tmp, "DevToolsActivePort"), time.time() + 30
        while not (os.path.exists(port_file) and open(port_file).read().count("\n") >= 1):
            if time.time() > deadline or proc.poll() is not None:
                raise RuntimeError("chromium did not start (no DevToolsActivePort)")
            time.sleep(0.1)
        port = int(open(port_file).read().split()[0])
        targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10))
        page = next(t for t in targets if t["type"] == "page")
        cdp = CDP(page["webSocketDebuggerUrl"], args.timeout)
        try:
            return drive(cdp, args)
        finally:
            cdp.ws.close()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # chromium and all its helper processes
        except ProcessLookupError:
            pass
        proc.wait()


def drive(cdp, args):
    page_url = args.page_url or args.url.rstrip("/") + "/"
    cdp.call("Page.enable")
    cdp.call("Page.navigate", url=page_url)
    deadline = time.time() + 30
    while cdp.js("document.readyState") != "complete" or not cdp.js("!!document.getElementById('input')"):
        if time.time() > deadline:
            raise RuntimeError(f"page did not load: {page_url}")
        time.sleep(0.1)
    if args.max_tokens:  # a setting, not under test: set it directly
        cdp.js(f"(e => {{ e.value = '{int(args.max_tokens)}'; e.dispatchEvent(new Event('change')); }})"
               f"(document.getElementById('max-tokens'))")
    if args.temperature is not None:  # likewise (0: the greedy answer, the same every run)
        cdp.js(f"(e => {{ e.value = '{float(args.temperature)}'; e.dispatchEvent(new Event('change')); }})"
               f"(document.getElementById('temperature'))")

    def center(sel):
        r = json.loads(cdp.js(f"JSON.stringify(document.querySelector('{sel}').getBoundingClientRect())"))
        return r["x"] + r["width"] / 2, r["y"] + r["height"] / 2

    def click(sel):
        x, y = center(sel)
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            cdp.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    click("#input")
    cdp.call("Input.insertText", text=args.message)
    typed = cdp.js("document.getElementById('input').value")
    if typed != args.message:
        raise AssertionError(f"#input holds {typed!r} after typing")
    # Besides polling every 50 ms, record every change of the answer text inside the page, so a fast
    # server whose whole answer arrives within one poll interval still shows its streaming steps.
    cdp.js("""window.__lens = []; new MutationObserver(() => {
      const a = [...document.querySelectorAll('#messages .msg.assistant .text')].pop();
      const n = a ? a.textContent.length : 0;
      if (n && window.__lens[window.__lens.length - 1] !== n) window.__lens.push(n);
    }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true})""")
    t0 = time.time()
    click("#send")

    lengths, state, deadline = [], None, t0 + args.timeout
    while True:
        state = json.loads(cdp.js(STATE_JS))
        n = len(state["assistant"] or "")
        if n and (not lengths or lengths[-1] != n):
            lengths.append(n)
        if state["done"] or state["errors"]:
            break
        if time.time() > deadline:
            raise AssertionError(f"no finished answer after {args.timeout}s: {state}")
        time.sleep(0.05)
    time.sleep(0.1)
    state = json.loads(cdp.js(STATE_JS))
    observed = cdp.js("window.__lens") or []

    if args.screenshot:
        png = base64.b64decode(cdp.call("Page.captureScreenshot", format="png")["data"])
        with open(args.screenshot, "wb") as f:
            f.write(png)

    checks = [
        (not state["errors"], f"error shown: {state['errors']}"),
        (state["user"] is not None and args.message in state["user"], f"user bubble is {state['user']!r}"),
        (bool((state["assistant"] or "").strip()), f"assistant bubble is empty: {state['assistant']!r}"),
        (state["done"], "assistant message has no data-done=\"1\""),
        ("tokens/s" in (state["stats"] or ""), f"stats line is {state['stats']!r}"),
        (len(set(lengths)) >= 2 or len(set(observed)) >= 2,
         f"answer did not stream: text lengths polled {lengths}, observed {observed}"),
    ]
    failed = [msg for ok, msg in checks if not ok]
    return {"ok": not failed, "failures": failed, "seconds": round(time.time() - t0, 2),
            "answer": state["assistant"], "stats": state["stats"], "polled_steps": len(lengths), "observed_steps": len(observed),
            "screenshot": args.screenshot}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8080")
    p.add_argument("--page-url", help="page to open (default: BASE/)")
    p.add_argument("--screenshot", help="save a PNG screenshot here")
    p.add_argument("--message", default="Say hello in five words.")
    p.add_argument("--max-tokens", type=int, default=48, help="value put into the page's max tokens field (0: keep)")
    p.add_argument("--temperature", type=float, default=None, help="value put into the page's temperature field")
    p.add_argument("--timeout", type=float, default=120)
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="chat_page_")
    try:
        result = run(args, tmp)
    except Exception as e:  # noqa: BLE001 - report any failure as one JSON line
        result = {"ok": False, "failures": [f"{type(e).__name__}: {e}"]}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result))
    if not result["ok"]:
        print("chat_page: FAILED: " + "; ".join(result["failures"]), file=sys.stderr)
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
