"""The SGLang backend against transformers on a tiny Qwen3 (fp32, CPU): generation shapes and finish reasons, n
samples, the logprob convention (processed: after temperature), teacher-forced scoring, weight updates (the outputs
change and equal a fresh engine's on the new weights), a stop that kills only its own engine. One engine serves the
module (a start costs 15-90 s here); skipped where SGLang is not installed."""
import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (contrib/rollout/sglang/requirements-sglang.txt)", allow_module_level=True)

from types import SimpleNamespace

import psutil

from rlcore.testing import tiny_checkpoint
from rlcore_model_qwen3.plugin import rlcore_models
from rlcore_rollout_sglang.backend import SGLangRollout

pytestmark = [pytest.mark.slow]

EOS = 0
PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
CFG = SimpleNamespace(tp=1, kv_cache_gib=0.01)
TOL = 2e-6      # fp32: measured <= 5e-7 against transformers


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-qwen3"))
    model = tiny_checkpoint(rlcore_models()[0], path, vocab_size=64, hidden_size=64, num_layers=2, num_heads=4,
                            num_kv_heads=2, head_dim=32, ffn_hidden_size=128, max_position_embeddings=256)
    return path, model


@pytest.fixture(scope="module")
def engine(checkpoint):
    rollout = SGLangRollout(checkpoint[0], CFG, seed=0, max_model_len=128)
    yield rollout
    rollout.stop()


def reference(model, sequence, start, temperature=1.0):
    """transformers' log p(sequence[j] | sequence[:j]) at ``temperature``, j >= start."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([sequence])).logits[0] / temperature, -1)
    return [logp[j - 1, sequence[j]].item() for j in range(start, len(sequence))]


def max_diff(a, b):
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def test_generate_shapes_and_finish_reasons(engine):
    out = engine.generate(PROMPTS, n=4, temperature=1.0, max_tokens=8, seeds=[1, 2, 3])
    assert [len(o) for o in out] == [4, 4, 4]
    reasons = set()
    for samples in out:
        for g in samples:
            assert 1 <= len(g.token_ids) <= 8 and len(g.logprobs) == len(g.token_ids)
            assert all(lp <= 0 for lp in g.logprobs)
            if g.finish_reason == "length":
                assert len(g.token_ids) == 8 and EOS not in g.token_ids
            else:
                assert g.finish_reason == "stop" and g.token_ids[-1] == EOS and EOS not in g.token_ids[:-1]
            reasons.add(g.finish_reason)
    assert len({tuple(g.token_ids) for g in out[0]}) > 1     # n distinct samples, not one repeated
    # enough samples that both endings occur with this checkpoint (vocabulary 64, eos id 0)
    more = engine.generate(PROMPTS, n=16, temperature=1.5, max_tokens=24)
    reasons |= {g.finish_reason for o in more for g in o}
    assert reasons == {"stop", "length"}


def test_logprobs_are_processed_after_temperature(engine, checkpoint):
    _, model = checkpoint
    out = engine.generate(PROMPTS, n=2, temperature=0.7, max_tokens=8, seeds=[1, 2, 3])
    for prompt, samples in zip(PROMPTS, out):
        for g in samples:
            seq = prompt + g.token_ids
            assert max_diff(g.logprobs, reference(model, seq, len(prompt), 0.7)) < TOL
            assert max_diff(g.logprobs, reference(model, seq, len(prompt), 1.0)) > 1e-3


def test_greedy_logprobs_equal_scoring_and_transformers(engine, checkpoint):
    _, model = checkpoint
    out = engine.generate(PROMPTS, n=1, temperature=0.0, max_tokens=8)
    sequences = [p + o[0].token_ids for p, o in zip(PROMPTS, out)]
    scored = engine.score(sequences, [len(p) for p in PROMPTS])
    for prompt, o, seq, s in zip(PROMPTS, out, sequences, scored):
        ref = reference(model, seq, len(prompt))
        assert max_diff(o[0].logprobs, ref) < TOL and max_diff(s, ref) < TOL
        # greedy: every generated token is transformers' argmax
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0]
        assert o[0].token_ids == logits[len(prompt) - 1:-1].argmax(-1).tolist()[:len(o[0].token_ids)]


def test_score_from_any_start(engine, checkpoint):
    _, model = checkpoint
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    for start in (1, 4, 9):
        assert max_diff(engine.score([seq], [start])[0], reference(model, seq, start)) < TOL


@pytest.mark.xfail(strict=True, reason="SGLang 0.5.23 honours per-request sampling_seed only in its deterministic "
                                       "mode, whose attention backends are GPU-only; passes once it does on CPU")
def test_seeds_make_samples_reproducible(engine):
    a = engine.generate(PROMPTS, n=3, temperature=1.0, max_tokens=8, seeds=[5, 6, 7])
    b = engine.generate(PROMPTS[::-1], n=3, temperature=1.0, max_tokens=8, seeds=[7, 6, 5])
    assert [[g.token_ids for g in o] for o in a] == [[g.token_ids for g in o] for o in b[::-1]]


def test_weight_update_changes_outputs_and_equals_a_fresh_engine(engine, checkpoint, tmp_path):
    path, model = checkpoint
    from safetensors.torch import load_file, save_file

    original = load_file(os.path.join(path, "model.safetensors"))
    torch.manual_seed(1)
    new = {k: v + torch.randn_like(v) * 0.2 for k, v in original.items()}
    before = engine.generate(PROMPTS, n=1, temperature=0.0, max_tokens=8)
    # a stream, in buckets of a few tensors each
    import rlcore_rollout_sglang.backend as backend

    bucket, backend.BUCKET_BYTES = backend.BUCKET_BYTES, 64 << 10
    try:
        engine.update_weights((name, tensor) for name, tensor in new.items())
    finally:
        backend.BUCKET_BYTES = bucket
    after = engine.generate(PROMPTS, n=1, temperature=0.0, max_tokens=8)
    assert [o[0].token_ids for o in after] != [o[0].token_ids for o in before]

    # transformers on the new weights, and a fresh engine started from them
    fresh_dir = tmp_path / "new"
    fresh_dir.mkdir()
    for f in os.listdir(path):
        if f != "model.safetensors":
            (fresh_dir / f).write_bytes(open(os.path.join(path, f), "rb").read())
    save_file(new, str(fresh_dir / "model.safetensors"))
    updated = type(model).from_pretrained(str(fresh_dir), dtype=torch.float32).eval()
    sequences = [p + o[0].token_ids for p, o in zip(PROMPTS, after)]
    scored = engine.score(sequences, [len(p) for p in PROMPTS])
    for prompt, seq, s in zip(PROMPTS, sequences, scored):
        assert max_diff(s, reference(updated, seq, len(prompt))) < TOL
    fresh = SGLangRollout(str(fresh_dir), CFG, seed=0, max_model_len=128)
    try:
        again = fresh.generate(PROMPTS, n=1, temperature=0.0, max_tokens=8)
        assert [o[0].token_ids for o in again] == [o[0].token_ids for o in after]
        for a, b in zip(again, after):
            assert max_diff(a[0].logprobs, b[0].logprobs) < TOL
        pids = set(fresh._pids)
    finally:
        fresh.stop()
        fresh.stop()        # idempotent
    # stop() ended the fresh engine's processes and no others: the module's engine still answers
    assert pids and not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                            for p in pids)
    assert all(psutil.pid_exists(p) for p in engine._pids)

    engine.update_weights(iter(original.items()))       # back to the checkpoint, for the other tests
    restored = engine.generate(PROMPTS, n=1, temperature=0.0, max_tokens=8)
    assert [o[0].token_ids for o in restored] == [o[0].token_ids for o in before]
