"""Issue 10, item 6: ids a worker registers are bounded and printable; the CLI escapes."""

from __future__ import annotations

import grpc
import pytest

from kvcache_service.admin_view import show_tree, table
from kvserve_proto.kvcache.v1 import kvcache_pb2 as pb
from tests.kvcache.test_servicer import AUTH, Client, client, expect_code  # noqa: F401


@pytest.mark.parametrize(
    "pool_id", ["x" * 1_000_000, "w\x00", "w\nINFO fake line", "\x1b[2J\x1b[31mw", "w 1", "é"]
)
async def test_bad_pool_ids_are_refused(client: Client, pool_id: str) -> None:  # noqa: F811
    await expect_code(grpc.StatusCode.INVALID_ARGUMENT, client.register(pool_id))
    assert (await client.admin.GetStats(pb.StatsRequest(), metadata=AUTH)).pools == []


async def test_ordinary_ids_pass(client: Client) -> None:  # noqa: F811
    await client.register("host-1.example:50061/w_2@x" + "x" * 100)


def test_cli_escapes_what_it_prints() -> None:
    out = table(["pool"], [["\x1b[2Jevil\nline"]])
    assert "\x1b" not in out and "\nline" not in out
    assert "\\x1b[2Jevil\\nline" in out
    tree = show_tree(pb.InspectTreeResponse(nodes=[pb.TreeNode(node_id=1, namespace="\x1b]0;")]))
    assert "\x1b" not in tree
