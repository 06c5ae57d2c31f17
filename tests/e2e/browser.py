"""Headless Chromium driven over the DevTools protocol on a pipe: no selenium, no websocket library.

`--remote-debugging-pipe` makes Chromium read protocol commands from fd 3 and write replies and
events to fd 4, each message JSON ending in a NUL byte. That is enough to load a page, collect
every console error, uncaught exception and failed load, query the DOM and take a screenshot.
"""

from __future__ import annotations

import base64
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

# Nothing may reach the network or need a GPU, a sandbox or a profile; CI containers often have
# a tiny /dev/shm, hence --disable-dev-shm-usage.
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--remote-debugging-pipe", "--hide-scrollbars", "--mute-audio",
]
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    """$CHROMIUM if set (it must then be an executable), else the first Chromium on PATH."""
    configured = os.environ.get("CHROMIUM")
    if configured:
        if shutil.which(configured) is None:
            raise BrowserError(f"CHROMIUM={configured!r} is not an executable")
        return shutil.which(configured)
    return next((path for path in map(shutil.which, CHROMIUM_NAMES) if path), None)


class BrowserError(RuntimeError):
    pass


@dataclass
class PageProblems:
    """Everything the page reported that a reader of the report would count as broken."""

    console_errors: list[str] = field(default_factory=list)
    exceptions: list[str] = field(default_factory=list)
    log_errors: list[str] = field(default_factory=list)  # failed loads, CSP and other browser errors

    def all(self) -> list[str]:
        return self.console_errors + self.exceptions + self.log_errors


class Chromium:
    """One headless browser with one page: `with Chromium(path) as browser: browser.open(url)`."""

    def __init__(self, executable: str, timeout: float = 60.0) -> None:
        self.executable = executable
        self.timeout = timeout
        self.problems = PageProblems()
        self._next_id = 0
        self._replies: dict[int, queue.Queue] = {}
        self._events: queue.Queue = queue.Queue()
        self._session: str | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ process and transport
    def __enter__(self) -> Chromium:
        self._profile = tempfile.TemporaryDirectory(prefix="npukit-chromium-")
        to_browser_read, to_browser_write = os.pipe()
        from_browser_read, from_browser_write = os.pipe()
        # Move the child's ends above fd 4 first, so placing them at 3 and 4 cannot clobber either.
        child_read = _fd_above(to_browser_read, 10)
        child_write = _fd_above(from_browser_write, 10)

        def place_pipe_fds() -> None:
            os.dup2(child_read, 3)  # dup2 leaves 3 and 4 inheritable; everything else is close-on-exec
            os.dup2(child_write, 4)

        self._process = subprocess.Popen(
            [self.executable, *CHROMIUM_FLAGS, f"--user-data-dir={self._profile.name}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            close_fds=False, preexec_fn=place_pipe_fds,
        )
        for fd in (child_read, child_write):
            os.close(fd)
        self._writer = os.fdopen(to_browser_write, "wb", buffering=0)
        self._reader = os.fdopen(from_browser_read, "rb", buffering=0)
        self._stderr_tail: list[str] = []
        threading.Thread(target=self._read_messages, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()
        target = self.send("Target.createTarget", url="about:blank", session=False)["targetId"]
        self._session = self.send("Target.attachToTarget", targetId=target, flatten=True, session=False)["sessionId"]
        for domain in ("Runtime", "Log", "Page"):
            self.send(f"{domain}.enable")
        return self

    def __exit__(self, *exc_info) -> None:
        try:
            self.send("Browser.close", session=False)
        except BrowserError:
            pass
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._writer.close()
        self._profile.cleanup()

    def _read_messages(self) -> None:
        buffer = b""
        while True:
            chunk = self._reader.read(1 << 16)
            if not chunk:
                self._events.put(None)
                for waiting in list(self._replies.values()):
                    waiting.put(None)
                return
            buffer += chunk
            *messages, buffer = buffer.split(b"\0")
            for raw in messages:
                message = json.loads(raw)
                if "id" in message:
                    self._replies.pop(message["id"], queue.Queue()).put(message)
                else:
                    self._record(message)
                    self._events.put(message)

    def _read_stderr(self) -> None:
        for line in self._process.stderr:
            self._stderr_tail = [*self._stderr_tail[-30:], line.decode(errors="replace").rstrip()]

    def send(self, method: str, session: bool = True, **params) -> dict:
        with self._lock:
            self._next_id += 1
            message_id = self._next_id
            reply_box: queue.Queue = queue.Queue()
            self._replies[message_id] = reply_box
        message = {"id": message_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self._session
        try:
            self._writer.write(json.dumps(message).encode() + b"\0")
            reply = reply_box.get(timeout=self.timeout)
        except (BrokenPipeError, queue.Empty) as exc:
            raise BrowserError(f"Chromium did not answer {method}: {exc!r}; stderr:\n" + "\n".join(self._stderr_tail)) from exc
        if reply is None:
            raise BrowserError(f"Chromium exited during {method}; stderr:\n" + "\n".join(self._stderr_tail))
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    # ------------------------------------------------------------------ page
    def _record(self, event: dict) -> None:
        params = event.get("params", {})
        if event["method"] == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert", "warning"):
            text = " ".join(str(arg.get("value", arg.get("description", ""))) for arg in params.get("args", []))
            self.problems.console_errors.append(f"console.{params['type']}: {text}")
        elif event["method"] == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            description = details.get("exception", {}).get("description") or details.get("text", "")
            self.problems.exceptions.append(f"line {details.get('lineNumber', '?')}: {description}")
        elif event["method"] == "Log.entryAdded" and params.get("entry", {}).get("level") in ("error", "warning"):
            entry = params["entry"]
            self.problems.log_errors.append(f"{entry.get('source')}: {entry.get('text')} {entry.get('url', '')}".strip())

    def open(self, url: str, width: int = 1280, height: int = 900) -> None:
        """Load url and wait for its load event."""
        self.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        navigation = self.send("Page.navigate", url=url)
        if navigation.get("errorText"):
            raise BrowserError(f"{url}: {navigation['errorText']}")
        while True:
            try:
                event = self._events.get(timeout=self.timeout)
            except queue.Empty as exc:
                raise BrowserError(f"{url}: no load event within {self.timeout:.0f} s") from exc
            if event is None:
                raise BrowserError("Chromium exited while loading " + url)
            if event["method"] == "Page.loadEventFired" and event.get("sessionId") == self._session:
                return

    def evaluate(self, expression: str):
        """Value of a JavaScript expression in the page (JSON-serialisable results)."""
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"evaluating {expression[:60]!r}: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float | None = None):
        """The first truthy value of a JavaScript expression, polled in the page every 5 ms."""
        limit = int(1000 * (timeout or self.timeout))
        value = self.evaluate(
            "new Promise((resolve, reject) => { const start = performance.now(); const poll = () => {"
            f" const value = ({expression}); if (value) resolve(value);"
            f" else if (performance.now() - start > {limit}) reject(new Error('timed out'));"
            " else setTimeout(poll, 5); }; poll(); })")
        return value

    def click(self, selector: str) -> None:
        """A real mouse click (pressed and released) at the middle of the first element matching selector,
        scrolled into view first: what a reader does, so a hidden or covered element is not clicked."""
        point = self.evaluate(
            f"(() => {{ const element = document.querySelector({json.dumps(selector)}); if (!element) return null;"
            " element.scrollIntoView({block: 'center', inline: 'nearest'}); const box = element.getBoundingClientRect();"
            " return {x: box.x + Math.min(box.width / 2, 40), y: box.y + box.height / 2}; })()")
        if point is None:
            raise BrowserError(f"no element matches {selector!r}")
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", type=kind, x=point["x"], y=point["y"], button="left",
                      clickCount=0 if kind == "mouseMoved" else 1)

    def screenshot(self, path: Path) -> bytes:
        """A PNG of the whole page (not only the viewport), written to path."""
        data = base64.b64decode(self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"])
        path.write_bytes(data)
        return data


def _fd_above(fd: int, minimum: int) -> int:
    import fcntl

    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, minimum)
    os.close(fd)
    return moved
