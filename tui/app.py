"""``appliance top``: a Textual dashboard of a running server, read over HTTP every second.

It shows the KV cache (usage and the block map of ``GET /v1/kv``), the queues (running, waiting), throughput
(prompt and generation tokens per second, requests per second, prefix-cache hit rate) and latency (TTFT, ITL,
end-to-end and queue time, p50 and p95) over the last ``window`` seconds, from ``GET /metrics`` (tui/metrics.py),
and the running requests with the blocks each holds. Keys: ``q`` quits, ``p`` pauses. When the server does not
answer, the last numbers stay, dimmed, the running requests are cleared, and the status line (under the header,
in view at any size) says why and how old the numbers are; polling goes on. After a gap longer than the window
(a pause, an outage) or a restart of the server (a counter went back), the window starts again. The block map
fits the terminal: as wide as it, fewer rows in a short one.
"""
from __future__ import annotations

import time
from collections import deque

import httpx
from rich import box
from rich.table import Table
from rich.text import Text
from textual import events
from textual.app import App, ComposeResult
from textual.css.query import NoMatches
from textual.widgets import DataTable, Footer, Header, Static

from tui.metrics import LATENCIES, Scrape, block_map, parse_metrics, view

#: Most rows and columns of the block map (fewer in a small terminal: :meth:`TopApp._map_shape`); each cell
#: covers num_blocks / (rows x columns) blocks, rounded up.
MAP_ROWS, MAP_COLUMNS = 6, 64
#: Lines the dashboard needs besides the block map's rows: header, status, summary (6 where 80 columns wrap it),
#: latency (title, header, rule, p50, p95), the table's header and five requests, the map's legend, footer
OTHER_LINES = 1 + 1 + 6 + 5 + 6 + 1 + 1
#: Columns of the screen the block map leaves: its margins (1 + 1) and a vertical scrollbar (2), shown when the
#: screen overflows
MAP_SPARE_COLUMNS = 4
_LABELS = {"time_to_first_token": "TTFT", "inter_token_latency": "ITL", "e2e_request_latency": "end to end",
           "request_queue_time": "queue"}


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.1f}"


def _message(response: httpx.Response) -> str:
    """The OpenAI-style error message of ``response``, else its text."""
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:200]


def _bar(fraction: float, width: int = 30) -> str:
    full = round(max(0.0, min(1.0, fraction)) * width)
    return "█" * full + "░" * (width - full)


class TopApp(App):
    """The dashboard of the server at ``url`` (``api_key``: sent as a bearer token, as /v1/* may need it)."""

    TITLE = "appliance top"
    #: ctrl+c quits too, as in top and htop (Textual's default only says to press ctrl+q)
    BINDINGS = [("q", "quit", "Quit"), ("ctrl+c", "quit", "Quit"), ("p", "toggle_pause", "Pause")]
    CSS = ("#summary, #latency, #blocks { height: auto; margin: 0 1; } #running { height: 1fr; margin: 0 1; } "
           "#status { height: 1; margin: 0 1; color: $warning; } .stale { text-opacity: 50%; }")
    #: seconds the server has to answer each reading
    TIMEOUT_S = 2.0

    def __init__(self, url: str, api_key: str | None = None, interval: float = 1.0, window: float | None = None):
        """``window``: seconds the rates and percentiles cover (default: 10, or three readings where
        ``interval`` is longer: a window shorter than two readings would never have a rate)."""
        super().__init__()
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.interval, self.window = interval, window if window is not None else max(10.0, 3 * interval)
        self.read_at: str | None = None  # the wall-clock time of the last reading shown, HH:MM:SS
        self.scrapes: deque[Scrape] = deque()
        self.kv: dict | None = None
        self.paused = False
        self.error: str | None = None
        self.client: httpx.AsyncClient | None = None
        self.shown = None  # the last View drawn

    def compose(self) -> ComposeResult:
        yield Header(show_clock=True)
        yield Static(id="status", markup=False)  # the server's words, brackets and all; first: in view at any size
        yield Static(id="summary")
        yield Static(id="latency")
        yield DataTable(id="running")
        yield Static(id="blocks")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = self.url
        self.client = httpx.AsyncClient(timeout=self.TIMEOUT_S, headers=self.headers)
        table = self.query_one("#running", DataTable)
        table.add_column("running request", key="id")
        table.add_column("KV blocks", key="blocks")
        self.run_worker(self.poll())  # the first reading right away, without holding up the first frame
        self.set_interval(self.interval, self.poll)

    async def on_unmount(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    def action_toggle_pause(self) -> None:
        self.paused = not self.paused
        if not self.paused:
            self.scrapes.clear()  # the window starts again
        self._say("paused (p resumes)" if self.paused else "")

    def _say(self, text: str) -> None:
        self.query_one("#status", Static).update(text)

    async def poll(self) -> None:
        """Read /metrics and /v1/kv once and redraw; a failure is shown in the status line."""
        if self.paused or self.client is None:
            return
        try:
            metrics = await self.client.get(f"{self.url}/metrics")
            kv = await self.client.get(f"{self.url}/v1/kv")
            metrics.raise_for_status()
            kv.raise_for_status()
        except httpx.HTTPStatusError as exc:  # 503 while the model loads: the server's message says so
            self.error = f"{self.url} answered {exc.response.status_code}: {_message(exc.response)}"
        except httpx.HTTPError as exc:  # a timeout's own text is empty
            self.error = (f"{self.url} does not answer: {exc.__class__.__name__}: "
                          f"{str(exc) or f'no answer in {self.TIMEOUT_S:g} s'}")
        else:
            try:
                scrape, self.kv, self.error = parse_metrics(metrics.text, time.monotonic()), kv.json(), None
            except ValueError as exc:
                self.error = f"{self.url} answered, but not with the server's metrics: {exc}"
        if self.paused:  # p was pressed while the requests were out
            return
        try:
            if self.error is not None:
                self._show_stale()
                return
            self._add_reading(scrape)
            self.redraw()
        except NoMatches:  # the app closed (q) while the requests were out: its widgets are gone
            return

    def _dim(self, stale: bool) -> None:
        """Mark the numbers (summary, latency, block map) stale or current."""
        for widget in self.query("#summary, #latency, #blocks"):
            widget.set_class(stale, "stale")

    def _show_stale(self) -> None:
        """The error, and the last numbers dimmed and dated; the running requests cleared (not known now)."""
        self._dim(True)
        self._show_requests([])
        self._say((f"numbers from {self.read_at}: " if self.read_at else "") + self.error)  # in front: never cut

    def _add_reading(self, scrape: Scrape) -> None:
        """Keep the readings of the last ``window`` seconds, and the newest one older than that; start again after
        a longer gap or when a counter went back (the server restarted)."""
        last = self.scrapes[-1] if self.scrapes else None
        if last is not None and (scrape.time - last.time > self.window or scrape.restarted_since(last)):
            self.scrapes.clear()
        self.scrapes.append(scrape)
        while len(self.scrapes) > 2 and scrape.time - self.scrapes[1].time >= self.window:
            self.scrapes.popleft()

    def redraw(self) -> None:
        new = self.scrapes[-1]
        old = self.scrapes[0] if len(self.scrapes) > 1 else None
        v = self.shown = view(old, new)
        kv = self.kv or {}
        self.read_at = time.strftime("%H:%M:%S")
        self._dim(False)
        self.query_one("#summary", Static).update(self._summary(new, v, kv))
        self.query_one("#latency", Static).update(self._latency(v))
        self.query_one("#blocks", Static).update(self._blocks(kv))
        self._show_requests(kv.get("running", []))
        self._say(f"updated {self.read_at}; rates over the last {v.seconds:.1f} s" if old
                  else "waiting for a second reading")

    def _show_requests(self, running: list[dict]) -> None:
        """The running requests' rows, updated in place (clearing the table would reset its scroll position)."""
        table = self.query_one("#running", DataTable)
        now = {r["request_id"]: str(r["num_blocks"]) for r in running}
        for key in [k for k in table.rows if k.value not in now]:
            table.remove_row(key)
        for rid, blocks in now.items():
            if rid in table.rows:
                table.update_cell(rid, "blocks", blocks)
            else:
                table.add_row(Text(rid), blocks, key=rid)

    @staticmethod
    def _summary(new: Scrape, v, kv: dict) -> Table:
        t = Table.grid(padding=(0, 2))
        t.add_column(style="bold")
        t.add_column()
        dtype = new.cache.get("cache_dtype", "")
        asleep = ("   waking: a request loads the model again" if kv.get("waking") else
                  "   asleep: unloaded, the next request loads it again" if kv.get("asleep") else "")
        t.add_row("model", Text(new.model + (f"   KV cache {dtype}" if dtype else "") + asleep))
        blocks = (f"{kv.get('used', 0):,} used, {kv.get('cached', 0):,} cached, {kv.get('free', 0):,} free of "
                  f"{kv.get('num_blocks', 0):,} blocks of {kv.get('block_size', 0)} tokens")
        t.add_row("KV cache", f"{_bar(v.kv_usage)} {v.kv_usage:.0%}   {blocks}")
        t.add_row("requests", f"{v.running} running, {v.waiting} waiting; {v.finished:,.0f} finished, "
                              f"{v.preemptions:,.0f} preemptions since start")
        hit = "-" if v.prefix_hit_rate is None else f"{v.prefix_hit_rate:.0%}"
        if v.seconds > 0:
            t.add_row("throughput", f"{v.generation_tok_s:,.1f} generated tok/s, {v.prompt_tok_s:,.1f} prompt "
                                    f"tok/s, {v.requests_per_s:.2f} req/s; prefix cache hits {hit}")
        else:  # one reading: no rate yet (0.0 would say the server is idle)
            t.add_row("throughput", f"- generated tok/s, - prompt tok/s, - req/s; prefix cache hits {hit}")
        return t

    @staticmethod
    def _latency(v) -> Table:
        t = Table(title="latency (ms)", title_justify="left", expand=False, box=box.SIMPLE_HEAD, show_edge=False)
        t.add_column("")
        for name in LATENCIES:
            t.add_column(_LABELS[name], justify="right")
        t.add_row("p50", *(_ms(v.percentiles[n][0]) for n in LATENCIES))
        t.add_row("p95", *(_ms(v.percentiles[n][1]) for n in LATENCIES))
        return t

    def _map_shape(self, size: tuple[int, int] | None = None) -> tuple[int, int]:
        """The block map's rows and columns for the terminal's ``size`` (columns, lines; default: the app's): at
        most :data:`MAP_ROWS` x :data:`MAP_COLUMNS`, no wider than the screen less :data:`MAP_SPARE_COLUMNS`, and in
        a short terminal only the rows left after :data:`OTHER_LINES` (at least one)."""
        width, height = size or self.size
        return max(1, min(MAP_ROWS, height - OTHER_LINES)), max(8, min(MAP_COLUMNS, width - MAP_SPARE_COLUMNS))

    def on_resize(self, event: events.Resize) -> None:
        """Redraw the block map for the new size (this handler runs before the app's own size is updated)."""
        if self.kv is not None and self.scrapes:
            self.query_one("#blocks", Static).update(self._blocks(self.kv, event.size))

    def _blocks(self, kv: dict, size: tuple[int, int] | None = None) -> Text:
        rows, columns = self._map_shape(size)
        cells = block_map(kv.get("blocks", ""), rows * columns)
        if not cells:
            return Text("block map: none")
        per = -(-len(kv["blocks"]) // (rows * columns))
        lines = [cells[i:i + columns] for i in range(0, len(cells), columns)]
        legend = f"KV blocks, {per}/cell: █ used ░▒▓▇ part c cached · free"  # short: fits 56 columns
        return Text("\n".join([legend, *lines]))
