"""A worker group (tensor parallel, issue 36) on this CPU: two ranks over MLX's ring backend on
loopback, the tiny model sharded with mlx-lm's shard(), each rank's pool holding its KV heads;
rank 0 drives the other through ``worker.model.group``. Greedy tokens identical to one process
(fp32), logits within float tolerance."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kvserve_model.tiny_model import TINY_MODEL_NAME
from tests.worker.group_rank import BLOCK_SIZE, NUM_BLOCKS, scenario
from worker.errors import UnsupportedModelError
from worker.group_launch import free_ports
from worker.model import group as groups
from worker.model.loader import load_model
from worker.model.runner import ModelRunner

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    mx.default_device() == mx.gpu, reason="the ring backend's CPU group; GPUs use NCCL"
)


def _run_group(tmp_path: Path, size: int = 2) -> list[dict]:
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(size)]))
    procs = []
    for rank in range(size):
        env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hosts)}
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.worker.group_rank"],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


@pytest.fixture(scope="module")
def group_run(tmp_path_factory) -> list[dict]:
    """Rank 0's and rank 1's results of the scenario in a 2-rank group (run once)."""
    return _run_group(tmp_path_factory.mktemp("group"))


@pytest.fixture(scope="module")
def single_run() -> dict:
    """The scenario in one unsharded process."""
    model = load_model(TINY_MODEL_NAME).model
    return scenario(ModelRunner.create(model, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS))


def test_two_ranks_decode_what_one_process_decodes(group_run, single_run):
    lead, follower = group_run
    single = single_run
    assert lead["size"] == 2 and lead["kv_heads"] == 2  # the tiny model's 4 KV heads, halved
    # prefill, copy on write, decodes, a refused batch, verify; read, write, read, forward
    assert follower["calls"] == 1 + 1 + 12 + 1 + 1 + 4
    assert lead["refused"] and single["refused"]
    assert lead["tokens"] == single["tokens"]
    np.testing.assert_allclose(lead["logits"], single["logits"], atol=1e-4, rtol=0)
    for got, want in zip(lead["verify"], single["verify"], strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_a_groups_tier_copies_are_whole_blocks_in_one_process_layout(group_run, single_run):
    """The tiers see a group's pool as whole blocks: a block read out of two ranks is the
    block one process holds (same layout, same size, values within float tolerance), so a
    tier file serves a worker of any group size; written back, every rank gets its own
    slice (the forward on the written blocks gives the logits of the prompt it came from;
    slices swapped between ranks would not), and a bad payload is refused on every rank."""
    lead, single = group_run[0], single_run
    assert lead["payload_bytes"] == single["payload_bytes"]
    assert lead["layout"] == single["layout"]
    np.testing.assert_allclose(lead["payload"], single["payload"], atol=1e-4, rtol=0)
    assert lead["reread_same"] and single["reread_same"]
    # The first prompt's last logits (its prefill's first row), computed again on its two
    # leading blocks written into other blocks.
    np.testing.assert_allclose(lead["reloaded"][0], lead["logits_prefill"][0], atol=1e-4, rtol=0)
    np.testing.assert_allclose(lead["reloaded"], single["reloaded"], atol=1e-4, rtol=0)
    assert lead["bad_payload_refused"] and single["bad_payload_refused"]


def test_a_model_that_cannot_be_sharded_is_refused_in_one_line():
    class Group:
        def size(self) -> int:
            return 3

    model = load_model(TINY_MODEL_NAME).model  # 8 heads, 4 KV heads: not over 3 ranks
    with pytest.raises(UnsupportedModelError, match="8 attention heads do not divide over 3"):
        groups.shard_model(model, Group())  # type: ignore[arg-type]

    class NoShard:
        model_type = "someformer"

    with pytest.raises(UnsupportedModelError, match="someformer: mlx-lm has no shard"):
        groups.shard_model(NoShard(), Group())  # type: ignore[arg-type]


def test_the_lookahead_is_refused_in_a_group():
    class Quiet(groups.Channel):
        def __init__(self) -> None:
            self.sent: list = []

        def send(self, message: object) -> None:
            self.sent.append(message)

    channel = Quiet()
    runner = groups.GroupRunner.__new__(groups.GroupRunner)
    runner._runner, runner._channel, runner.group_size = None, channel, 2
    with pytest.raises(ValueError, match="no forward on lazy tokens"):
        runner.forward_async([], mx.array([1]))
    assert channel.sent == []


def test_a_rank_loads_only_its_share_of_the_weights():
    """The weights load lazily and are sharded before anything is evaluated: a rank of two
    holds half of every layer's projections (the embedding, tied to the head, whole)."""
    from mlx.utils import tree_flatten

    class Rank1of2:
        def size(self) -> int:
            return 2

        def rank(self) -> int:
            return 1

    def count(model) -> int:
        return sum(v.size for _, v in tree_flatten(model.parameters()))

    full = load_model(TINY_MODEL_NAME).model
    part = load_model(
        TINY_MODEL_NAME,
        shard=lambda m: groups.shard_model(m, Rank1of2()),  # type: ignore[arg-type]
    ).model
    embedding = full.model.embed_tokens.weight.size
    assert count(part) - embedding == pytest.approx((count(full) - embedding) / 2, rel=0.01)
    layer = part.model.layers[0].self_attn
    assert (layer.n_heads, layer.n_kv_heads) == (4, 2)  # 8 and 4 heads, halved


def test_ranks_that_start_on_their_own_get_the_environment_mlx_launch_would_set(tmp_path):
    """``--group-hosts`` (every rank's host:port, ``{ordinal}`` the number ending this host's
    name, as a StatefulSet pod's) and ``--group-rank``: the ring's hosts file of those names,
    this rank, the group's size; NCCL: rank 0's address as the rendezvous."""
    from worker.group_launch import OWN_HOSTFILE_ENV, join_env, ordinal

    assert ordinal("worker-rank1-12") == "12" and ordinal("gpu-node") == ""
    hosts = "worker-{ordinal}.w.ns.svc:5100,worker-rank1-{ordinal}.r.ns.svc:5100"
    env = join_env(hosts, 1, "ring", hostname="worker-rank1-3")
    try:
        assert (env["MLX_RANK"], env["MLX_WORLD_SIZE"], env["KVSERVE_GROUP_BACKEND"]) == (
            "1",
            "2",
            "ring",
        )
        assert json.loads(Path(env["MLX_HOSTFILE"]).read_text()) == [
            ["worker-3.w.ns.svc:5100"],
            ["worker-rank1-3.r.ns.svc:5100"],
        ]
        assert env[OWN_HOSTFILE_ENV] == env["MLX_HOSTFILE"]  # deleted once the ranks joined
    finally:
        os.unlink(env["MLX_HOSTFILE"])
    nccl = join_env("localhost:6000,localhost:6000", 0, "nccl")
    assert (nccl["NCCL_HOST_IP"], nccl["NCCL_PORT"]) == ("127.0.0.1", "6000")
    with pytest.raises(ValueError, match="ends in none"):
        join_env(hosts, 0, "ring", hostname="gpu-node")


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--tensor-parallel", "2", "--group-hosts", "a:1"], "names 1 ranks"),
        (["--tensor-parallel", "2", "--group-hosts", "a:1,b"], "host:port entries"),
        (["--tensor-parallel", "2", "--group-hosts", "a:1,b:2", "--group-rank", "2"], "0..1"),
        (["--group-rank", "1"], "needs --group-hosts"),
    ],
)
def test_group_flags_that_disagree_are_refused(argv, problem):
    from worker.config import WorkerConfig

    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()) as err:
        WorkerConfig.from_args(argv)
    assert problem in err.getvalue()
    ok = WorkerConfig.from_args(
        ["--tensor-parallel", "2", "--group-hosts", "a:1,b:2", "--group-rank", "1"]
    )
    assert (ok.group_hosts, ok.group_rank) == ("a:1,b:2", 1)
