"""A job request: built once from parsed HTTP fields, checked without the database."""

from pathlib import Path

import pytest

from app.errors import BadInput, BadTokens
from app.submission.request import JobRequest, Request, check_request
from tests.conftest import make_test_settings


@pytest.fixture
def settings(tmp_path: Path):
    return make_test_settings(database_url=f"sqlite:///{tmp_path / 'db.sqlite'}", artifact_root=tmp_path)


def test_fields_a_body_left_out_take_the_defaults_and_unknown_ones_are_not_taken() -> None:
    request = JobRequest.of({"voice_id": "narrator", "tokens": [1, 2], "output_format": None,
                             "shape": "ignored"})
    assert request == JobRequest(voice_id="narrator", tokens=[1, 2], output_format="wav", priority=0)


def test_a_checked_request_keeps_what_defines_the_job_and_a_seed_is_chosen_when_left_open(settings) -> None:
    checked, seed = check_request(settings=settings, request=JobRequest(
        text="Hello there.", voice_id="v", priority=3, idempotency_key="k"))
    assert checked == Request(tokens=None, text="Hello there.", language="en", seed=None, output_format="wav",
                              priority=3, idempotency_key="k")
    assert 0 <= seed < 2**31
    assert check_request(settings=settings, request=JobRequest(tokens=(5, 6), seed=9))[0].tokens == [5, 6]
    assert check_request(settings=settings, request=JobRequest(tokens=[5], seed=9))[1] == 9


@pytest.mark.parametrize(("request_", "error"), [
    (JobRequest(), BadTokens), (JobRequest(tokens=[1], text="hi"), BadInput),
    (JobRequest(tokens=[1], language="en"), BadInput), (JobRequest(tokens=[1], priority=10), BadInput),
    (JobRequest(tokens=[1], idempotency_key=""), BadInput),
    (JobRequest(tokens=[1], output_format="ogg"), BadInput),
])
def test_a_request_outside_the_rules_is_refused_before_anything_is_stored(settings, request_: JobRequest,
                                                                           error: type[Exception]) -> None:
    with pytest.raises(error):
        check_request(settings=settings, request=request_)
