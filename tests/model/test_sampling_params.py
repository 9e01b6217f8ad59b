"""kvserve_model.sampling_params: the one reading of a worker.v1.SamplingParams message, shared
by the gateway's gRPC edge and the worker's."""

from __future__ import annotations

import pytest

from kvserve_model.sampling_limits import SamplingLimitError, check_sampling
from kvserve_model.sampling_params import SPECULATIVE_VALUES, SamplingParams
from kvserve_proto.worker.v1 import worker_pb2 as pb


def test_the_wire_zeros_read_as_the_proto_documents_them() -> None:
    assert SamplingParams.from_wire(pb.SamplingParams()) == SamplingParams()
    params = SamplingParams.from_wire(pb.SamplingParams(seed=0, skip_special_tokens=False))
    assert (params.seed, params.skip_special_tokens) == (0, False)
    assert SamplingParams().greedy


def test_every_field_travels() -> None:
    sent = SamplingParams(
        temperature=0.5,
        top_p=0.75,  # exact in float32, as on the wire
        top_k=40,
        min_p=0.0625,
        seed=-3,
        max_tokens=12,
        stop=("\n", "END"),
        stop_token_ids=(2, 7),
        ignore_eos=True,
        logprobs=3,
        repetition_penalty=1.25,
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        speculative="draft_model",
        num_draft_tokens=5,
    )
    fields = {k: getattr(sent, k) for k in SamplingParams.__dataclass_fields__}
    fields["speculative"] = SPECULATIVE_VALUES[sent.speculative]
    msg = pb.SamplingParams(**fields)
    assert SamplingParams.from_wire(msg) == sent
    # The wire enum and the names agree.
    assert SPECULATIVE_VALUES == {
        "": pb.SPECULATIVE_OFF,
        "ngram": pb.SPECULATIVE_NGRAM,
        "draft_model": pb.SPECULATIVE_DRAFT_MODEL,
    }


def test_an_unknown_speculative_method_is_refused_by_name() -> None:
    params = SamplingParams.from_wire(pb.SamplingParams(speculative=7))  # type: ignore[arg-type]
    with pytest.raises(SamplingLimitError, match="speculative"):
        check_sampling(params, vocab_size=256)


@pytest.mark.parametrize("field", ["top_p", "repetition_penalty"])
def test_a_negative_value_is_refused_not_read_as_off(field: str) -> None:
    params = SamplingParams.from_wire(pb.SamplingParams(**{field: -0.5}))
    with pytest.raises(SamplingLimitError, match=field):
        check_sampling(params, vocab_size=256)
