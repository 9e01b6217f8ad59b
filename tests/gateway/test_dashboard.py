"""The cache dashboard over plain HTTP (the browser test is tests/e2e/test_dashboard.py): the
page and its files load without a token under a strict CSP; every data endpoint needs the
admin token; hostile text from the cache comes back as data, and the page's script never
turns data into markup.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from gateway.dashboard import ASSETS, CSP
from tests.gateway.conftest import ADMIN_TOKEN, AUTH, Stack, released
from tests.gateway.fake_worker import MODEL
from tests.gateway.test_shards import Sharded, sharded  # noqa: F401 (a fixture)

STATIC = Path(__file__).resolve().parents[2] / "gateway" / "static"
DATA = ["/admin/dashboard/stats", "/admin/dashboard/tree?pool=w0"]
# A prompt that is markup, a bidi override, quotes and a newline: what a client may send.
HOSTILE = "<script>alert(1)</script><img src=x onerror=alert(2)>\u202e\"'&\n</td>"


class Tags(HTMLParser):
    """Every start tag of a page with its attributes, and whether a script has a body."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.inline_script = False
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._in_script = tag == "script"

    def handle_endtag(self, tag: str) -> None:
        self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script and data.strip():
            self.inline_script = True


async def test_the_page_loads_without_a_token_under_a_strict_csp(stack: Stack) -> None:
    page = await stack.http.get("/dashboard")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert csp == CSP
    for directive in ("default-src 'none'", "script-src 'self'", "style-src 'self'",
                      "connect-src 'self'", "form-action 'none'", "frame-ancestors 'none'"):  # fmt: skip
        assert directive in csp
    assert "unsafe" not in csp and "http" not in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    assert page.headers["referrer-policy"] == "no-referrer"

    tags = Tags()
    tags.feed(page.text)
    assert not tags.inline_script
    for tag, attrs in tags.tags:
        assert "style" not in attrs, tag
        assert not [a for a in attrs if a.startswith("on")], (tag, attrs)
        if tag == "script":
            assert attrs["src"] == "/dashboard/dashboard.js"
        for a in ("src", "href"):  # only this origin's files
            assert not (attrs.get(a) or "/").startswith(("http", "//")), attrs
        assert tag != "style"
    assert "name" not in dict(next(a for t, a in tags.tags if t == "input"))

    for name, media in ASSETS.items():
        r = await stack.http.get(f"/dashboard/{name}")
        assert r.status_code == 200, name
        assert r.headers["content-type"] == media
        assert r.content == (STATIC / name).read_bytes()
    for missing in ("/dashboard/nope.js", "/dashboard/..%2Fdashboard.py", "/dashboard/a/b"):
        r = await stack.http.get(missing)
        assert r.status_code == 404, missing
        assert r.json()["error"]["message"]
    schema = (await stack.http.get("/openapi.json")).json()
    assert "/dashboard" not in schema["paths"]
    assert "/admin/dashboard/stats" in schema["paths"]


@pytest.mark.parametrize("path", DATA)
async def test_every_data_endpoint_needs_the_admin_token(stack: Stack, path: str) -> None:
    await stack.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello there"})
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {ADMIN_TOKEN}"},
        {"Authorization": ADMIN_TOKEN},
        {"Authorization": f"Bearer {ADMIN_TOKEN}x"},
    ):
        r = await stack.http.get(path, headers=headers)
        assert r.status_code == 401, (path, headers)
        assert set(r.json()) == {"error"}  # nothing of the cache leaks with the refusal
        assert r.json()["error"]["type"] == "authentication_error"
    r = await stack.http.get(path, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.headers["cache-control"] == "no-store"
    # The token goes in the header only: not taken from the query string.
    r = await stack.http.get(f"{path}{'&' if '?' in path else '?'}token={ADMIN_TOKEN}")
    assert r.status_code == 401


async def test_stats_are_numbers_with_the_gateways_worker_view(stack: Stack) -> None:
    served = await stack.http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "Count the blocks, please."}
    )
    pool = served.headers["x-kvserve-worker"]
    await released(stack)
    await stack.poll()
    body = (await stack.http.get("/admin/dashboard/stats", headers=AUTH)).json()
    assert body["model"] == MODEL and body["cache_service"] == stack.cache.address
    pools = {p["pool_id"]: p for p in body["pools"]}
    assert sorted(pools) == ["w0", "w1"]
    p = pools[pool]
    for k in ("num_blocks", "free_blocks", "cached_blocks", "referenced_blocks", "pinned_blocks",
              "live_leases", "acquires", "acquire_hits", "prompt_tokens", "cached_tokens",
              "evicted_blocks", "expired_leases", "incarnation"):  # fmt: skip
        assert type(p[k]) is int, k  # protobuf's JSON would have written uint64 as strings
    assert p["acquires"] >= 1 and p["prompt_tokens"] >= len("Count the blocks, please.")
    assert p["free_blocks"] + p["cached_blocks"] + p["referenced_blocks"] == p["num_blocks"]
    assert p["cached_blocks"] > 0 and p["alive"] is True
    assert p["worker"]["healthy"] is True and p["worker"]["address"] == p["worker_address"]
    assert p["worker"]["in_flight"] == 0 and p["worker"]["running"] == 0


async def test_the_tree_carries_hostile_text_as_data(stack: Stack) -> None:
    served = await stack.http.post(
        "/v1/completions", json={"model": MODEL, "prompt": HOSTILE, "cache_salt": "<b>ns</b>"}
    )
    assert served.status_code == 200, served.text
    pool = served.headers["x-kvserve-worker"]
    await released(stack)
    r = await stack.http.get(f"/admin/dashboard/tree?pool={pool}", headers=AUTH)
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    assert r.headers["x-content-type-options"] == "nosniff"
    tree = r.json()
    assert tree["tokenizer"] == MODEL and not tree["truncated"]
    nodes = {n["id"]: n for n in tree["nodes"]}
    assert nodes and {n["namespace"] for n in nodes.values()} == {"<b>ns</b>"}

    def path_text(n: dict) -> str:
        return (path_text(nodes[n["parent"]]) if n["parent"] else "") + n["text"]

    # The prompt, byte for byte, along the path to the deepest node (tokens past a node's
    # preview are not shown, but every node here is shorter than a preview).
    deepest = max(nodes.values(), key=lambda n: n["depth"])
    assert all(n["preview_complete"] for n in nodes.values())
    assert path_text(deepest).startswith(HOSTILE)
    assert any("<script>" in n["text"] for n in nodes.values())
    for n in nodes.values():
        assert n["ids"] and n["tokens"] == len(n["ids"]) and n["blocks"] >= 1
        assert n["referenced"] == 0 and n["idle_s"] is not None and n["idle_s"] >= 0


async def test_tree_arguments_are_checked(stack: Stack) -> None:
    for prompt in ("A first prompt for the tree.", "Another prompt, another branch."):
        await stack.http.post(
            "/v1/completions", json={"model": MODEL, "prompt": prompt, "cache_salt": "t"}
        )
    await released(stack)
    http = stack.http
    assert (await http.get("/admin/dashboard/tree", headers=AUTH)).status_code == 400
    assert (await http.get("/admin/dashboard/tree?pool=nope", headers=AUTH)).status_code == 404
    for bad in ("0", "-1", "5001", "many"):
        r = await http.get(f"/admin/dashboard/tree?pool=w0&max_nodes={bad}", headers=AUTH)
        assert r.status_code == 400, bad
        assert r.json()["error"]["param"] == "max_nodes"
    sizes = {}
    for pool in ("w0", "w1"):
        r = await http.get(f"/admin/dashboard/tree?pool={pool}", headers=AUTH)
        sizes[pool] = r.json()["total_nodes"]
    pool = max(sizes, key=lambda p: sizes[p])
    one = (await http.get(f"/admin/dashboard/tree?pool={pool}&max_nodes=1", headers=AUTH)).json()
    assert len(one["nodes"]) == 1 and one["nodes"][0]["parent"] == 0
    assert one["truncated"] is (sizes[pool] > 1)
    other = await http.get(f"/admin/dashboard/tree?pool={pool}&namespace=other", headers=AUTH)
    assert other.json()["nodes"] == []


def test_the_script_never_writes_markup() -> None:
    """Data reaches the page through textContent and properties only: none of the sinks that
    parse HTML or run code appears in the script (nor any inline style or script in the page,
    which the CSP would block)."""
    js = (STATIC / "dashboard.js").read_text()
    code = "\n".join(line for line in js.splitlines() if not line.lstrip().startswith("//"))
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(",
                 "new Function", "setAttribute(\"style", "srcdoc", "DOMParser",
                 "createContextualFragment", "location.search", "localStorage"):  # fmt: skip
        assert sink not in code, sink
    assert re.search(r"setTimeout\(\s*[\"'`]", code) is None  # a string would be eval'd
    assert "sessionStorage" in code and "Authorization" in code


async def test_a_sharded_cache_service_shows_every_shards_pools(
    sharded: Sharded,  # noqa: F811 (the fixture imported above)
) -> None:
    """The stats merge every shard's pools; a pool's tree comes from its own shard; a wrong
    token is still a 401, not a shard left out."""
    served = await sharded.http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "Which shard holds me?"}
    )
    pool = served.headers["x-kvserve-worker"]
    await sharded.poll()
    body = (await sharded.http.get("/admin/dashboard/stats", headers=AUTH)).json()
    assert body["cache_service"] == ",".join(s.address for s in sharded.shards)
    assert sorted(p["pool_id"] for p in body["pools"]) == ["a0", "a1", "b0", "b1"]
    assert all(p["worker"]["healthy"] for p in body["pools"])
    for p in ("a0", "b1", pool):
        r = await sharded.http.get(f"/admin/dashboard/tree?pool={p}", headers=AUTH)
        assert r.status_code == 200, r.text
    tree = (await sharded.http.get(f"/admin/dashboard/tree?pool={pool}", headers=AUTH)).json()
    assert any(n["text"].startswith("Which shard") for n in tree["nodes"])
    for path in ("/admin/dashboard/stats", f"/admin/dashboard/tree?pool={pool}"):
        r = await sharded.http.get(path, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401, path
