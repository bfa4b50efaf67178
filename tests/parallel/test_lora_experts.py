"""LoRA on MoE experts (rlcore.lora.layers): a tiny Qwen3-MoE GPTModel with adapters on every target (attention,
every routed expert's fc1/fc2), on gloo at EP1, EP2 and TP2 with sequence parallelism (expert TP 1, as rlcore builds
it); a tiny Qwen2-MoE (a gated shared expert beside the routed ones) at EP1 and EP2.

The adapters are set from per-projection (PEFT-style) random adapters, one pair per expert, through the model's own
weight rules, keyed by the expert's model-wide index: the logits equal those of the base model with the merged
weights W + B A * scale (the full-matrix LoRA, computed unsharded), so they agree between layouts; adapters off give
the base model exactly; --dry-run's count is the adapters built. One backward pass over a batch split over the
data-parallel ranks: the adapters' gradients, reduced as Megatron DDP reduces them (the dense ones over data
parallelism, the experts' over expert data parallelism, the flag each factor carries) and gathered over EP, equal the
one-process gradients of the whole batch. At TP1 (EP1, EP2) the adapters in PEFT's layout (``rlcore.lora.peft``: the
experts of a layer stacked into PEFT's parameter LoRA on transformers' fused expert tensors) loaded by
``PeftModel.from_pretrained`` give the same logits, and PEFT's lora_A / lora_B gradients of the same loss equal ours
mapped alike. The EP1 run's adapter checkpoint is read at EP2 and at TP2: every factor exactly; ``rlcore export``'s
PEFT adapter of it, loaded by PEFT, gives EP2's logits."""
import textwrap

import pytest
import torch
from ranks import RUN_JOBS, run_jobs_by_world

# processes, TP, EP, sequence parallel (megatron-core asks for it with MoE and TP)
LAYOUTS = {"ep1": (1, 1, 1, 0), "ep2": (2, 1, 2, 0), "tp2-sp": (2, 2, 1, 1)}
MOE = dict(vocab_size=16, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffn_hidden_size=32,
           max_position_embeddings=32, num_experts=4, experts_per_token=2)

SCRIPT = textwrap.dedent("""
    import importlib, json, torch, torch.distributed as dist
    torch.set_num_threads(1)
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
    from rlcore.lora.peft import (expert_target_parameters, peft_expert_factors, peft_expert_state_dict,
                                  peft_factors, peft_state_dict, target_modules)
    from rlcore.lora.config import LoRAConfig
    from rlcore.lora.layers import ColumnLoRA, LoRAAdapter, adapters_enabled, add_lora
    from rlcore.megatron.checkpoint import load_weights, save_weights
    from rlcore.megatron.model import build_gpt, load_hf_into, read_hf_config, read_hf_weights
    from rlcore.megatron.parallel import init_parallel
    from rlcore.sizing import _moe_layers, adapter_params
    from rlcore.megatron.names import global_name
    from rlcore_testing.lora import set_random_adapters

    def moe_job(path, tp, ep, sp, save_to, resume_from, names_to, plugin, spec_name):
        # save_to, resume_from: a checkpoint of the adapters to write / to load ("-": none); names_to: where rank 0
        # writes the PEFT adapter's target names at TP1
        SPEC = getattr(importlib.import_module(plugin), spec_name)
        init_parallel(tp=tp, ep=ep)
        dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
        hf_config, hf = read_hf_config(path), dict(read_hf_weights(path).items())
        all_ids = torch.randint(1, 16, (4, 12), generator=torch.Generator().manual_seed(1))
        all_g = torch.randn(4, 12, 16, generator=torch.Generator().manual_seed(2))
        ids, g = all_ids.chunk(dp)[dp_rank], all_g.chunk(dp)[dp_rank]     # this data-parallel rank's sequences

        def gathered(t, group):
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, t.contiguous(), group=group)
            return parts

        def logits(model):   # [b, s, V] of the whole batch: vocabulary slices and data-parallel parts gathered
            with torch.no_grad():
                local = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
            whole = torch.cat(gathered(local, mpu.get_tensor_model_parallel_group()), -1)
            return torch.cat(gathered(whole, mpu.get_data_parallel_group()), 0)

        def built(weights):
            model, converter = build_gpt(SPEC, hf_config, sequence_parallel=sp)
            load_hf_into(model, converter, weights)
            return model.eval(), converter

        model, converter = built(hf)
        base = logits(model)
        cfg = LoRAConfig(rank=4, alpha=8.0)
        params = add_lora(model, cfg)
        local_experts = len(model.decoder.layers[0].mlp.experts.local_experts)
        shared = 2 if model.config.moe_shared_expert_intermediate_size else 0   # a shared expert's fc1 and fc2
        assert len(params) == 2 * (2 + shared + 2 * local_experts) * hf_config["num_hidden_layers"], len(params)
        sized = sum(adapter_params(model.config, cfg.rank, cfg.target_modules, moe, tp, ep)
                    for moe in _moe_layers(model.config))   # what --dry-run counts: one TP and EP rank's adapters
        assert sized == sum(p.numel() for p in params), (sized, sum(p.numel() for p in params))
        assert not any("router" in n for n, p in model.named_parameters() if p.requires_grad)
        untouched = logits(model)

        merged = set_random_adapters(model, converter, hf, cfg, std=0.2)
        adapted = logits(model)
        resumed = {}
        if save_to != "-":
            save_weights(model, save_to)
        if resume_from != "-":   # saved at EP1: a fresh model's adapters (another seed) read at this layout
            fresh, _ = built(hf)
            add_lora(fresh, LoRAConfig(rank=4, alpha=8.0, seed=1))
            load_weights(fresh, resume_from)
            same = all(torch.equal(getattr(a.lora, f), getattr(b.lora, f))
                       for a, b in zip(model.modules(), fresh.modules())
                       if isinstance(getattr(a, "lora", None), LoRAAdapter) for f in "AB")
            resumed = {"resumed": logits(fresh), "resumed_factors_equal": torch.tensor([float(same)])}
        with adapters_enabled(model, False):
            off = logits(model)
        reference, _ = built(merged)   # the base model with the merged weights: full-matrix LoRA, unsharded
        expected = logits(reference)

        model.train()
        y = gather_from_tensor_model_parallel_region(model(ids, torch.arange(ids.shape[1]).expand_as(ids), None))
        (y * g).sum().backward()
        model.ddp_config = DistributedDataParallelConfig()   # the factors tagged sequence_parallel: summed over TP
        _allreduce_non_tensor_model_parallel_grads([model], model.config, mpu.get_tensor_model_parallel_group())
        grads, entries = {}, model.sharded_state_dict()
        for name, module in model.named_modules():
            adapter = getattr(module, "lora", None)
            if not isinstance(adapter, LoRAAdapter):
                continue
            # Megatron DDP: a factor flagged allreduce=False (an expert's) is reduced over expert data parallelism,
            # any other over data parallelism
            expert_flag = adapter.A.allreduce is False
            assert expert_flag == adapter.expert and adapter.B.allreduce is adapter.A.allreduce, name
            group = mpu.get_expert_data_parallel_group() if expert_flag else mpu.get_data_parallel_group()
            for p in (adapter.A, adapter.B):
                dist.all_reduce(p.grad, group=group)
            global_weight = global_name(model, f"{name}.weight")
            rule = converter.rule(global_weight)
            sharded, replicated = ("B", "A") if isinstance(adapter, ColumnLoRA) else ("A", "B")
            shards = gathered(getattr(adapter, sharded).grad, adapter.tp_group)
            grads.update({f"grad.{n}.lora_{sharded}": t.contiguous() for n, t in rule.to_hf(shards, converter.layout)})
            grads[f"grad.{rule.megatron}.lora_{replicated}"] = getattr(adapter, replicated).grad
            if adapter.expert:   # its checkpoint entry: the layer's experts' key, at the expert's model-wide index
                entry = entries[f"{name}.lora.A"]
                expert = int(global_weight.split(".")[6])
                assert entry.key.endswith("mlp.experts.experts." + name.rsplit(".", 1)[1] + ".lora.A"), entry.key
                assert entry.global_offset[1] == expert, (name, entry.global_offset)
        # at TP1 each factor and its gradient are whole on their rank: gathered, and put into PEFT's layout
        # (rlcore.lora.peft: per projection, the experts of a layer stacked) for the comparison with transformers + PEFT
        megatron_form = {}
        for name, module in model.named_modules():
            adapter = getattr(module, "lora", None)
            if isinstance(adapter, LoRAAdapter):
                megatron_form[global_name(model, f"{name}.weight")] = (
                    isinstance(adapter, ColumnLoRA), adapter.A.detach(), adapter.B.detach(), adapter.A.grad,
                    adapter.B.grad)
        all_grads, everything = [None] * dist.get_world_size(), {}
        dist.all_gather_object(all_grads, (grads, megatron_form if tp == 1 else {}))
        if dist.get_rank() != 0:
            return {}
        whole = {}
        for other, factors in all_grads:
            whole.update(factors)
            for k, v in other.items():
                everything.setdefault(k, v)
        if tp == 1:
            shared_a = set()
            for prefix, (a_at, b_at) in (("peft.", (1, 2)), ("peft_grad.", (3, 4))):
                dense, experts = [], {}
                for name, t in sorted(whole.items()):
                    if ".local_experts." in name:
                        layer, expert = name.split(".local_experts.")[0], int(name.split(".")[6])
                        experts.setdefault((layer, name.rsplit(".", 2)[1]), []).append((expert, name, t[a_at],
                                                                                        t[b_at]))
                    else:
                        projections = peft_factors(converter, name, [t[a_at]], [t[b_at]], t[0])
                        dense += projections
                        if t[0] and len(projections) > 1:   # a fused column adapter: its A, every projection's
                            shared_a.add(tuple(m for m, _, _ in projections))
                layers = [peft_expert_factors(converter, [(n, a, b) for _, n, a, b in sorted(v)])
                          for v in experts.values()]
                state = {**peft_state_dict(dense), **peft_expert_state_dict(layers)}
                everything.update({prefix + k: v.clone() for k, v in state.items()})
            with open(names_to, "w") as f:
                json.dump({"modules": target_modules({m for m, _, _ in dense}, converter.hf_names()),
                           "parameters": expert_target_parameters(layers), "shared_a": sorted(shared_a)}, f)
        return {**resumed, "ids": all_ids, "g": all_g, "base": base, "untouched": untouched, "adapted": adapted,
                "off": off, "expected": expected, **everything}
""") + RUN_JOBS


# family -> (plugin module, model spec, HF config class, shared experts): Qwen2-MoE adds a gated shared expert
FAMILIES = {"qwen3_moe": ("rlcore_model_qwen3.plugin", "QWEN3_MOE", "Qwen3MoeConfig", False),
            "qwen2_moe": ("rlcore_model_qwen2.plugin", "QWEN2_MOE", "Qwen2MoeConfig", True)}
CASES = [("qwen3_moe", layout) for layout in sorted(LAYOUTS)] + [("qwen2_moe", "ep2")]


def spec_of(family):
    import importlib

    module, spec, _, _ = FAMILIES[family]
    return getattr(importlib.import_module(module), spec)


def tiny_moe(directory, family):
    """A random tiny checkpoint of the family written by transformers, its router spread so that tokens go to every
    expert."""
    import transformers

    path = directory / "ckpt"
    torch.manual_seed(0)
    config = getattr(transformers, FAMILIES[family][2])(**spec_of(family).tiny_hf_config(**MOE))
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    model.save_pretrained(path)
    return path


def transformers_with_peft(checkpoint, got: dict, names_file, directory):
    """transformers' model of ``checkpoint`` with PEFT's adapter of the layout's adapters (rlcore.lora.peft's
    layout, the experts through PEFT's target_parameters): its logits on the script's batch, and the gradients of
    the script's loss wrt each lora_A / lora_B, keyed as the adapter file keys them."""
    import json

    from peft import PeftModel
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from rlcore.lora.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_config
    from rlcore.lora.config import LoRAConfig

    names = json.loads(names_file.read_text())
    directory.mkdir()
    save_file({k.removeprefix("peft."): v for k, v in got.items() if k.startswith("peft.")},
              str(directory / ADAPTER_WEIGHTS))
    (directory / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(LoRAConfig(rank=4, alpha=8.0), names["modules"],
                                                                      str(checkpoint), names["parameters"])))
    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(directory), is_trainable=True)
    logits = model(input_ids=got["ids"]).logits
    (logits * got["g"]).sum().backward()
    grads = {n.replace(".default", ""): p.grad for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads, names["shared_a"]


def exported_adapter_logits(spec, checkpoint, saved, directory, ids):
    """``rlcore export``'s PEFT adapter directory of the adapter checkpoint ``saved`` (read in a world of one, as
    rlcore export reads it), loaded by ``PeftModel.from_pretrained`` onto transformers' model: its logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlcore.export import checkpoint_peft_adapter, write_peft_adapter
    from rlcore.lora.config import LoRAConfig
    from rlcore.megatron.model import read_hf_config
    from rlcore.megatron.parallel import init_parallel

    init_parallel()
    write_peft_adapter(str(directory), *checkpoint_peft_adapter(str(saved), spec, read_hf_config(str(checkpoint)),
                                                                "float32", LoRAConfig(rank=4, alpha=8.0),
                                                                str(checkpoint)))
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32),
                                      str(directory))
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(family, layout) -> (the run's outputs, its PEFT target names file), for CASES and each family's EP1 run;
    family -> (its tiny checkpoint, the adapter checkpoint its EP1 run saves for the other layouts to read). Every
    run of one world size in one torchrun (ranks.RUN_JOBS), the EP1 runs first."""
    tmp = tmp_path_factory.mktemp("lora_moe")
    paths, jobs = {}, {}
    for family in FAMILIES:
        (tmp / family).mkdir()
        paths[family] = tiny_moe(tmp / family, family), tmp / family / "adapters"
    for family, layout in [(family, "ep1") for family in FAMILIES] + CASES:
        procs, tp, ep, sp = LAYOUTS[layout]
        saved = str(paths[family][1])
        save_to, resume_from = (saved, "-") if layout == "ep1" else ("-", saved)
        jobs[family, layout] = procs, {"run": "moe_job", "args": [
            str(paths[family][0]), tp, ep, bool(sp), save_to, resume_from, str(tmp / family / f"{layout}.json"),
            *FAMILIES[family][:2]]}
    results = run_jobs_by_world(SCRIPT, tmp, jobs)
    return {key: (got, tmp / key[0] / f"{key[1]}.json") for key, got in results.items()}, paths


@pytest.mark.parametrize("family, layout", CASES)
@pytest.mark.slow
@pytest.mark.parallel
def test_expert_adapters_equal_merged_weights_in_every_layout(tmp_path, runs, family, layout):
    results, paths = runs
    checkpoint, saved = paths[family]
    (got, names), (one_process, _) = results[family, layout], results[family, "ep1"]   # EP1 is the reference
    if layout != "ep1":   # the EP1 checkpoint's adapters, each expert's read by its model-wide index
        assert got["resumed_factors_equal"].item() == 1.0, f"{layout}: the adapters read from EP1's differ"
        assert torch.equal(got["resumed"], got["adapted"])
    assert torch.equal(got["untouched"], got["base"]), "fresh adapters (B = 0) changed the logits"
    assert torch.equal(got["off"], got["base"]), "adapters off is not the base model exactly"
    moved = (got["adapted"] - got["base"]).abs().max().item()
    assert moved > 0.1, moved
    assert (got["adapted"] - got["expected"]).abs().max().item() <= 1e-5 * (1 + moved)
    assert (got["adapted"] - one_process["adapted"]).abs().max().item() <= 1e-5 * (1 + moved)
    grads = sorted(n for n in got if n.startswith("grad."))
    # per layer: q/k/v B + A, o_proj A + B, and per expert (and the shared one) gate/up B + A, down_proj A + B
    experts = MOE["num_experts"]
    assert grads == sorted(n for n in one_process if n.startswith("grad.")), grads
    shared = 3 + 2 if FAMILIES[family][3] else 0
    assert len(grads) == MOE["num_layers"] * (4 + 2 + experts * (3 + 2) + shared), len(grads)
    for name in grads:
        want = one_process[name]
        assert want.abs().max() > 0, name
        assert (got[name] - want).abs().max().item() <= 1e-5 * (1 + want.abs().max().item()), name
    if LAYOUTS[layout][1] == 1:   # TP1: the same adapters, in PEFT's layout, on transformers' model
        logits, peft_grads, shared_a = transformers_with_peft(checkpoint, got, names, tmp_path / "peft")
        assert (logits - got["adapted"]).abs().max().item() <= 1e-5 * (1 + moved)
        ours = {k.removeprefix("peft_grad."): v for k, v in got.items() if k.startswith("peft_grad.")}
        assert sorted(ours) == sorted(peft_grads)
        assert any(".experts.base_layer.lora_A" in k for k in ours) and any(".experts.lora_B" in k for k in ours)
        for modules in shared_a:   # q/k/v (gate/up) share one A: its gradient is the sum of theirs
            key = "base_model.model.{}.lora_A.weight"
            total = sum(peft_grads[key.format(m)] for m in modules)
            for m in modules:
                peft_grads[key.format(m)] = total
        for key, want in peft_grads.items():
            assert (ours[key] - want).abs().max().item() <= 1e-5 * (1 + want.abs().max().item()), key
    if layout == "ep2":   # rlcore export's PEFT adapter of the EP1 checkpoint, loaded by PEFT: EP2's logits
        logits = exported_adapter_logits(spec_of(family), checkpoint, saved, tmp_path / "exported", got["ids"])
        assert (logits - got["adapted"]).abs().max().item() <= 1e-5 * (1 + moved)


@pytest.mark.slow
def test_expert_targets_reach_every_expert_and_never_the_router():
    """``linear_fc1``/``linear_fc2`` on a MoE model adapt every routed expert (one adapter each, named by the
    expert), nothing else is trainable, the router never; a linear adapted twice is refused by name."""
    import re

    from rlcore.lora.config import LoRAConfig
    from rlcore.lora.layers import add_lora
    from rlcore.megatron.model import build_gpt
    from rlcore.megatron.parallel import init_parallel
    from rlcore_model_qwen3.plugin import QWEN3_MOE

    init_parallel()
    model, _ = build_gpt(QWEN3_MOE, QWEN3_MOE.tiny_hf_config(**MOE))
    params = add_lora(model, LoRAConfig(target_modules=("linear_fc1", "linear_fc2")))
    assert len(params) == 2 * 2 * MOE["num_experts"] * MOE["num_layers"]
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{linear}.lora.{f}" for i in range(MOE["num_layers"])
        for e in range(MOE["num_experts"]) for linear in ("linear_fc1", "linear_fc2") for f in "AB"}
    with pytest.raises(ValueError, match=re.escape("LoRA on decoder.layers.0.mlp.experts.local_experts.0.linear_fc1: "
                                                   "the linear already has an adapter")):
        add_lora(model, LoRAConfig(target_modules=("linear_fc1",)))
