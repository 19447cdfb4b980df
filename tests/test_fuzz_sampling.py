"""Fuzzing ``SamplingParams`` (issue 15): every field, across types and ranges, with hypothesis.

Properties: a record is either refused with a RequestError that names one of its fields, or it
becomes params whose device tensors hold exactly what was asked (numpy's float32/int32 are the
judge) and which run through the engine without a failed step."""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxinfer.errors import RequestError
from jaxinfer.sampling.sampler import SamplingParams, SamplingTensors

FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
INT_FIELDS = ("top_k", "seed", "max_tokens", "min_tokens", "logprobs")
BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.text(max_size=5),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
any_int = st.one_of(
    st.integers(-3, 70),
    st.integers(-(2**70), 2**70),
    st.sampled_from([2**31 - 1, 2**31, -(2**31), 2**32, 2**63, -1, 0]),
)
any_float = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(-3, 3),
    st.sampled_from([1e-46, 1e-300, 1e-39, 1.2e-38, 3.5e38, 1e300, -0.0, 5e-324]),
)


def field_values(name):
    if name in FLOAT_FIELDS:
        return st.one_of(any_float, any_int, junk)
    if name in INT_FIELDS:
        return st.one_of(any_int, any_float, junk)
    if name in BOOL_FIELDS:
        return st.one_of(st.booleans(), junk, any_int)
    if name == "stop":
        return st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3), junk)
    return st.one_of(st.lists(any_int, max_size=3), junk)  # stop_token_ids


FIELDS = FLOAT_FIELDS + INT_FIELDS + BOOL_FIELDS + ("stop", "stop_token_ids")
# Many fields at once, and one field at a time (so each field's edges meet valid neighbours).
records = st.one_of(
    st.fixed_dictionaries({}, optional={name: field_values(name) for name in FIELDS}),
    st.sampled_from(FIELDS).flatmap(lambda n: st.fixed_dictionaries({n: field_values(n)})),
)


def _device_exact(sp: SamplingParams) -> None:
    """The sampling tensors hold the Python values: float32 keeps zero / non-zero and finiteness,
    int32 keeps top_k."""
    t = SamplingTensors.from_params([sp], [sp.seed or 0], [0], pad_to=1)
    for name in FLOAT_FIELDS:
        py, dev = getattr(sp, name), float(getattr(t, name)[0])
        assert math.isfinite(dev), name
        assert (py == 0) == (dev == 0), (name, py, dev)
        if py != 0:
            assert abs(dev) >= np.finfo(np.float32).tiny, (name, py)
    assert int(t.top_k[0]) == sp.top_k


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records)
def test_a_record_is_refused_naming_a_field_or_reaches_the_device_exactly(rec):
    try:
        sp = SamplingParams.from_dict(rec)
    except RequestError as e:
        assert any(name in str(e) for name in rec), (rec, str(e))
        return
    _device_exact(sp)


valid = st.builds(
    SamplingParams,
    temperature=st.one_of(st.just(0.0), st.floats(1e-5, 5.0)),
    top_p=st.one_of(st.just(1.0), st.floats(float(np.finfo(np.float32).tiny), 1.0)),
    top_k=st.one_of(st.just(0), st.integers(1, 2**31 - 1)),
    min_p=st.floats(0.0, 1.0).filter(lambda x: x == 0 or x >= np.finfo(np.float32).tiny),
    repetition_penalty=st.floats(float(np.finfo(np.float32).tiny), 1e30),
    presence_penalty=st.floats(-2.0, 2.0).filter(lambda x: x == 0 or abs(x) >= 1.2e-38),
    frequency_penalty=st.floats(-2.0, 2.0).filter(lambda x: x == 0 or abs(x) >= 1.2e-38),
    seed=st.one_of(st.none(), st.integers(-(2**70), 2**70)),
    max_tokens=st.integers(1, 6),
    stop=st.lists(st.text(min_size=1, max_size=3), max_size=2),
    stop_token_ids=st.lists(st.integers(0, 511), max_size=3),
    ignore_eos=st.booleans(),
    logprobs=st.one_of(st.none(), st.integers(0, 20)),
    include_stop_str_in_output=st.booleans(),
)


@pytest.fixture(scope="module")
def fuzz_llm(stories_llm):
    return stories_llm


@settings(
    max_examples=4,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
    ],
)
@given(st.lists(valid, min_size=24, max_size=24))
def test_valid_params_never_break_a_step(fuzz_llm, batch):
    llm = fuzz_llm
    failures = llm.engine.num_step_failures
    outs = llm.generate(["Once upon a time"] * len(batch), batch)
    assert llm.engine.num_step_failures == failures
    for sp, out in zip(batch, outs, strict=True):
        assert out.error is None, out.error
        assert 1 <= len(out.token_ids) <= sp.max_tokens
        assert all(0 <= t < llm.config.vocab_size for t in out.token_ids)
