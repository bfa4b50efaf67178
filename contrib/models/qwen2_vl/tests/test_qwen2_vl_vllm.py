"""A tiny Qwen2.5-VL served by vLLM (its CPU build) against transformers (fp32): image prompts reach the engine
token-in with the trained model's tokens (each image's run of placeholders, which the backend hands vLLM as one) and
the images; the prompt vLLM builds is the one its own text path builds; logprobs agree before and after a weight push
that changes the vision tower (whose cached image embeddings the push must drop); a banned placeholder is never
sampled, where an unbanned one is. The checks run in order on one engine in a spawned child process (vLLM allows
one in-process engine per process, and the test session's quickstart fixture may hold one); the tests read what
they measured."""
import multiprocessing

import pytest

pytestmark = pytest.mark.slow
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    from rlcore_testing.vision import served_image_checks

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(served_image_checks, (str(tmp_path_factory.mktemp("vl")),))


def test_engine_logprobs_on_image_prompts_equal_transformers(measured):
    print(f"max |engine - transformers| logprob {measured['gap_before']:.1e}")
    assert measured["gap_before"] < TOLERANCE


def test_token_in_prompt_is_the_text_paths_prompt(measured):
    """vLLM's own processing of the text with one placeholder per image expands it to the trained model's tokens."""
    assert measured["text_path_prompt"] == measured["token_in_prompt"]


def test_weight_push_that_changes_the_vision_tower(measured):
    """The push drops the engine's cached image embeddings: the images scored before are scored with the new tower."""
    print(f"after the push: max |engine - transformers| logprob {measured['gap_after']:.1e}")
    assert measured["gap_after"] < TOLERANCE


def test_a_banned_placeholder_is_never_sampled(measured):
    """Weights whose final norm is zero make every next token equally likely: sampled freely, the four vision
    tokens (of 64) show up; banned, never."""
    vision = set(range(60, 64))
    assert vision & set(measured["sampled_free"]) and len(measured["sampled_banned"]) == 8 * 16
    assert not vision & set(measured["sampled_banned"])
