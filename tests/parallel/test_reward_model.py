"""Scalar reward models against transformers' AutoModelForSequenceClassification: published configs scaled down
(Llama-3.1-8B, Qwen2.5-7B-Instruct, Qwen2.5-0.5B with its tied embeddings, Qwen3-8B as sequence classifiers), each
with its pad-token rule (a pad token, one that is also the end of sequence, none), scored in a padded batch at TP1,
TP2 and PP2: every score within 1e-5 of transformers'."""
import textwrap

import pytest
import torch

from rlcore_testing.models import published_config
from ranks import RUN_JOBS, run_jobs_by_world

SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=96, vocab_size=64, max_position_embeddings=64)
PAD, EOS = 61, 62

# name -> (published config, pad_token_id, end of sequence appended to some sequences)
CASES = {
    "llama-3.1-8b-pad": ("llama-3.1-8b", PAD, EOS),
    "llama-3.1-8b-pad-is-eos": ("llama-3.1-8b", EOS, EOS),      # read before a trailing end of sequence
    "qwen2.5-7b-instruct-no-pad": ("qwen2.5-7b-instruct", None, EOS),   # the last token, one sequence at a time
    "qwen2.5-0.5b-tied-pad": ("qwen2.5-0.5b", PAD, EOS),
    "qwen3-8b-pad-is-eos": ("qwen3-8b", EOS, EOS),
}
FAMILY_PLUGINS = ["llama", "qwen2", "qwen3"]
LAYOUTS = {"tp1": (1, 1, 1), "tp2": (2, 2, 1), "pp2": (2, 1, 2)}     # world, tp, pp

RANK = textwrap.dedent("""
    import torch
    torch.set_num_threads(1)
    from rlcore.config.schema import ParallelConfig, RewardModelConfig
    from rlcore.megatron.model import read_hf_config, read_hf_weights
    from rlcore.megatron.reward_model import MegatronRewardModel, family_of, read_scores, score_batch
    from rlcore.plugins import load_plugins

    def run(path, tp, pp, sequences):
        hf = read_hf_config(path)
        spec = family_of(load_plugins(["llama", "qwen2", "qwen3"]).registry.models, hf)
        cfg = RewardModelConfig(micro_batch_size=3, parallel=ParallelConfig(tp=tp, pp=pp))
        model = MegatronRewardModel(spec, hf, cfg, None, hf_state=read_hf_weights(path))
        batch = score_batch(sequences, hf.get("pad_token_id"))
        return {"scores": read_scores(model.per_token_scores(batch), batch)}
""") + RUN_JOBS


def sequences(case: str) -> list[list[int]]:
    """Seven sequences of 3 to 12 tokens (none of them the pad token), three ending in the end of sequence."""
    _, pad, eos = CASES[case]
    g = torch.Generator().manual_seed(len(case))
    out = []
    for i in range(7):
        tokens = torch.randint(0, PAD, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        out.append(tokens + [eos] if i % 2 else tokens)
    return out


def write_classifier(case: str, directory) -> torch.nn.Module:
    """A random sequence classifier of the case's published config (sizes scaled down), saved as transformers
    saves one; returns it (eval)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    name, pad, _ = CASES[case]
    base = published_config(name, **SIZES)
    hf = {**base, "architectures": [base["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")],
          "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}, "pad_token_id": pad,
          "bos_token_id": 0, "eos_token_id": EOS}
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(AutoConfig.for_model(**hf)).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
        model.score.weight.normal_(0, 1.0)     # scores of order 1: a misread position shows
    model.save_pretrained(directory, max_shard_size="100KB")
    return model.eval()


def transformers_scores(model, seqs: list[list[int]], pad: int | None) -> torch.Tensor:
    """transformers' scores: the batch right-padded with the pad token (its own rule finds each score's position);
    without a pad token it takes one sequence at a time (it refuses a batch)."""
    with torch.no_grad():
        if pad is None:
            return torch.cat([model(torch.tensor([s])).logits[:, 0] for s in seqs])
        width = max(map(len, seqs))
        ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        return model(ids, attention_mask=mask).logits[:, 0]


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    """Every case at every layout, in two torchrun starts (one per world size)."""
    root = tmp_path_factory.mktemp("reward_models")
    expected, jobs = {}, {}
    for case in CASES:
        path = root / case
        model = write_classifier(case, path)
        expected[case] = transformers_scores(model, sequences(case), CASES[case][1])
        for layout, (world, tp, pp) in LAYOUTS.items():
            jobs[(case, layout)] = (world, {"run": "run", "args": [str(path), tp, pp, sequences(case)]})
    return expected, run_jobs_by_world(RANK, root, jobs)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_scores_equal_transformers(scored, case, layout):
    expected, results = scored
    ours = results[(case, layout)]["scores"].double()
    assert ours.shape == expected[case].shape
    assert expected[case].abs().max() > 0.1            # the scores are not all near zero
    diff = (ours - expected[case].double()).abs().max().item()
    assert diff < 1e-5, f"{case} at {layout}: scores differ from transformers' by {diff}"


def test_score_positions_follow_transformers_rule():
    from rlcore.megatron.reward_model import score_positions

    assert score_positions([[5, 6, 7], [5, 9, 9], [9, 9]], pad_id=9) == [2, 0, 0]
    assert score_positions([[5, 6, 7], [5, 9, 9]], pad_id=None) == [2, 2]
