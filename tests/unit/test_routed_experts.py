"""Routed experts on their way from the engine to the learner (``rlcore.routed_experts``): a resumed request's and a
multi-turn episode's routes keep each token's first route, the batch lays them out by token position with -1 where
none is known, and the routing metrics count what differs."""
import pytest
import torch

from rlcore.data import Batch
from rlcore.learner.routing import routing_metrics
from rlcore.rollout.pausable import _joined
from rlcore.routed_experts import MISSING, ROUTED_EXPERTS, batch_routes, differing, joined
from rlcore.specs import Completion
from rlcore.trajectory import Trajectory, to_batch


def routes(n: int, start: int = 0, layers: int = 2, top_k: int = 2) -> torch.Tensor:
    """``n`` distinct recognisable rows: token i's experts are (start + i, start + i + 1) in every layer."""
    ids = torch.arange(start, start + n).view(n, 1, 1) + torch.arange(top_k).view(1, 1, top_k)
    return ids.expand(n, layers, top_k).to(torch.int16).clone()


def test_a_resent_sequence_keeps_the_first_routes_and_appends_the_new_tokens():
    first, again = routes(5), routes(8, start=100)
    got = joined(first, again)
    assert torch.equal(got[:5], first) and torch.equal(got[5:], again[5:])
    assert joined(first, None) is None and joined(None, again) is None
    with pytest.raises(ValueError, match="changed shape"):
        joined(first, routes(8, layers=3))


def test_partial_rollout_parts_join_into_one_completions_routes():
    """Prompt of 4 tokens; part one samples 3 (routes of 4 + 3 - 1 = 6 tokens), part two 2 more (8 tokens fed)."""
    one = Completion("r", [5, 6, 7], [-1.0] * 3, "abort", (0, 0), routes(6))
    empty = Completion("r/r1", [], [], "abort", (1, 1), None)          # aborted before sampling: skipped
    two = Completion("r/r2", [8, 9], [-1.0] * 2, "stop", (1, 1), routes(8, start=50))
    done = _joined("r", [one, empty, two], "stop", 1)
    assert done.tokens == [5, 6, 7, 8, 9] and len(done.routed_experts) == 4 + 5 - 1
    assert torch.equal(done.routed_experts[:6], routes(6)) and torch.equal(done.routed_experts[6:], routes(8, 50)[6:])


def test_multi_turn_transcript_takes_the_observations_routes_from_the_next_prefill():
    from rlcore_agent_tools.chat import Transcript

    transcript = Transcript([1, 2, 3])
    transcript.sampled([4, 5], [-1.0, -1.0], routes(4))               # fed: 3 prompt + 1 sampled
    transcript.inserted([6, 7])                                        # an observation
    transcript.sampled([8], [-1.0], routes(7, start=30))               # fed: the 7 tokens before it
    trajectory = transcript.trajectory()
    assert torch.equal(trajectory.routed_experts[:4], routes(4))
    assert torch.equal(trajectory.routed_experts[4:], routes(7, 30)[4:]) and len(trajectory.routed_experts) == 7


def test_the_batch_holds_routes_by_token_position_with_gaps_marked():
    a = Trajectory.single_turn([1, 2], [3, 4], [-1.0, -1.0], routed_experts=routes(3))
    b = Trajectory.single_turn([1], [2], [-1.0])                       # an engine part without routes
    batch = to_batch([a, b], pad_id=0)
    got = batch[ROUTED_EXPERTS]
    assert got.shape == (2, 4, 2, 2) and got.dtype == torch.int16
    assert torch.equal(got[0, :3], routes(3)) and (got[0, 3] == MISSING).all() and (got[1] == MISSING).all()
    assert ROUTED_EXPERTS not in to_batch([b], pad_id=0)
    with pytest.raises(ValueError, match="differ in shape"):
        batch_routes([routes(2), routes(2, layers=3)], 4)
    with pytest.raises(ValueError, match="cover 5 tokens"):
        Trajectory.single_turn([1], [2], [-1.0], routed_experts=routes(5))


def test_differing_compares_expert_sets_and_ignores_unrouted_positions():
    learner = torch.tensor([[[1, 0]], [[2, 3]], [[0, 1]]])
    rollout = torch.tensor([[[0, 1]], [[2, 4]], [[-1, -1]]], dtype=torch.int16)
    assert differing(learner, rollout).flatten().tolist() == [False, True, False]


def test_routing_metrics_count_tokens_layers_and_incomplete_rows():
    rows = routes(4, layers=2).unsqueeze(0).repeat(2, 1, 1, 1)        # [2, 4, 2, 2]
    rows[0, 3] = MISSING                                               # row 0: 4 tokens, the last never fed
    rows[1, 2:] = MISSING                                              # row 1: 4 tokens, token 2 fed but unrouted
    batch = Batch({"input_ids": torch.ones(2, 4, dtype=torch.long), "prompt_len": torch.tensor([2, 2]),
                   "response_len": torch.tensor([2, 2]), ROUTED_EXPERTS: rows,
                   "rollout_logprobs": torch.full((2, 4), -1.0), "response_mask": torch.tensor([[0, 1, 1, 0]] * 2)})
    differing_layers = torch.tensor([[0, 2, 0, 0], [1, 0, 0, 0]])     # 5 routed tokens: 2 differ, 3 of 10 layers
    live = torch.full((2, 4), -1.0)
    metrics = routing_metrics(batch, live, differing_layers)
    assert metrics["routing/token_differs_frac"] == pytest.approx(2 / 5)
    assert metrics["routing/layer_differs_frac"] == pytest.approx(3 / 10)
    assert metrics["routing/rows_incomplete"] == 1.0
    assert metrics["routing/live_abs_diff_mean"] == 0.0
