"""SamplingParams validation: every invalid value raises InvalidRequestError naming the field."""

from __future__ import annotations

import pytest

from kvforge.engine.sampling_params import SamplingParams
from kvforge.errors import InvalidRequestError, KVForgeError

INVALID = [
    ("n", 0),
    ("n", True),
    ("n", 1.0),
    ("temperature", -0.1),
    ("temperature", "hot"),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", True),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", -1),
    ("top_k", -2),
    ("top_k", 2.5),
    ("top_k", True),
    ("min_p", -0.01),
    ("min_p", 1.01),
    ("seed", 1.5),
    ("seed", True),
    ("seed", "42"),
    ("seed", 1 << 63),
    ("seed", -(1 << 63) - 1),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 3.0),
    ("max_tokens", False),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", 2.0),
    ("logprobs", True),
    ("stop", [""]),
    ("stop", ["ok", 3]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["a"]),
    ("stop_token_ids", [True]),
    ("allowed_token_ids", [True]),
]


@pytest.mark.parametrize("field,value", INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_value_names_field(field, value):
    with pytest.raises(InvalidRequestError) as ei:
        SamplingParams(**{field: value})
    assert ei.value.field == field
    assert field in str(ei.value)
    assert isinstance(ei.value, KVForgeError)


def test_defaults_and_valid_edges():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1, 1.0, 1.0, -1, 0.0, 16)
    assert not p.is_greedy
    assert SamplingParams(temperature=0).is_greedy
    SamplingParams(top_p=1.0, top_k=0, min_p=1.0, max_tokens=None, logprobs=0, seed=0)
    SamplingParams(logprobs=20, top_k=1, seed=-3)


def test_stop_normalized_to_tuples():
    p = SamplingParams(stop="###", stop_token_ids=[1, 2])
    assert p.stop == ("###",) and p.stop_token_ids == (1, 2)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop=None).stop == ()
    hash(SamplingParams(stop=["x"]))  # frozen and hashable


def test_numpy_scalars_are_the_numbers_they_hold():
    """Harnesses build parameters with numpy; each scalar is taken as the Python number it holds (and stored so:
    equal and hashable like one built from Python numbers)."""
    np = pytest.importorskip("numpy")
    p = SamplingParams(n=np.int32(2), max_tokens=np.int64(5), temperature=np.float32(0.5), top_k=np.int64(3),
                       seed=np.uint16(9), stop_token_ids=np.array([3, 4]), allowed_token_ids=[np.int64(7)],
                       logit_bias={np.int64(4): np.float32(1.5)})
    assert p == SamplingParams(n=2, max_tokens=5, temperature=0.5, top_k=3, seed=9, stop_token_ids=[3, 4],
                               allowed_token_ids=[7], logit_bias={4: 1.5})
    assert type(p.max_tokens) is int and type(p.temperature) is float and type(p.stop_token_ids[0]) is int
    hash(p)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        SamplingParams(max_tokens=np.int64(0))
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=np.float64("nan"))


def test_clone_copies_with_changes_and_validates():
    params = SamplingParams(temperature=0.5, max_tokens=8, stop=["x"], structured_outputs={"regex": "a+"})
    assert params.clone() == params and params.clone() is not params
    changed = params.clone(max_tokens=4)
    assert changed.max_tokens == 4 and params.max_tokens == 8 and changed.stop == ("x",)
    with pytest.raises(InvalidRequestError):
        params.clone(top_p=2.0)


@pytest.mark.parametrize("field", ["ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "detokenize"])
@pytest.mark.parametrize("value", ["false", 0, 1, None])
def test_switches_take_only_booleans(field, value):
    """A switch given a string ("false" reads as true) or a number is refused by name, not taken by truth."""
    with pytest.raises(InvalidRequestError, match=f"{field}: must be true or false"):
        SamplingParams(**{field: value})


def test_numpy_booleans_are_the_switches_they_hold():
    np = pytest.importorskip("numpy")
    params = SamplingParams(ignore_eos=np.bool_(True), skip_special_tokens=np.bool_(False))
    assert params.ignore_eos is True and params.skip_special_tokens is False


@pytest.mark.parametrize("field", ["allowed_token_ids", "stop_token_ids"])
def test_one_id_where_a_list_is_due_is_refused_by_name(field):
    with pytest.raises(InvalidRequestError, match=f"{field}"):
        SamplingParams(**{field: 5})
