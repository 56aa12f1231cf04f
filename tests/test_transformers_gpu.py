"""transformers MoE models on the GPU with their experts replaced by ours, generating under torch.compile
with CUDA graphs (mode="reduce-overhead": Inductor's cudagraph trees), against the models' own experts.

The nearest thing to a served model on the H200 machine (no vLLM or SGLang there): a small
Qwen3-MoE and a small DeepSeek-V3 (grouped top-k with correction bias, shared expert, routed
scaling, MLA), random init from a config. Each `*Experts` module is swapped for `AtomExperts`:
our prepared weights (from the module's own gate_up_proj / down_proj, gate first), a
persistent workspace and one `torch.ops.atom_moe.experts` call, so the Triton kernels run
inside the captured graphs. The router, attention and shared expert stay transformers' own.

Checks: greedy tokens equal the model's own experts (eager) up to the first near-tie of the
reference, every compared logprob within the bf16 bound of tests/test_vllm_serve.py; two
batches of different size and content (new routing) replay the decode graphs, shown by our
op's Python body running far fewer times than the forwards do; no cudagraph skip.
"""

from __future__ import annotations

import pytest
import torch

from atom_moe import ops
from atom_moe.experts import allocate_workspace
from atom_moe.spec import MoESpec
from atom_moe.weights import prepare_stacked

pytestmark = pytest.mark.gpu

BF16_STEP = 2.0**-8
LOGIT_MAX = 8.0
# The model's own experts round to bf16 after the gate/up matmul, the activation product, the
# down matmul, the routing weight and each of the k accumulations into the output (index_add_
# on a bf16 tensor); ours round twice (the intermediate, the output) with fp32 accumulation.
# Per MoE layer that is a few bf16 steps of the experts' output; STEPS of the logits bounds it.
STEPS = 4
NEW_TOKENS = 12
MAX_TOKENS = 256  # the workspace's capacity: the largest prefill below is 3 x 24 tokens

COMMON = dict(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.2)
CONFIGS = {
    "qwen3_moe": dict(head_dim=64, intermediate_size=512, moe_intermediate_size=256, num_experts=16,
                      num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    # MLA: one latent KV per head (num_key_value_heads = num_attention_heads)
    "deepseek_v3": dict(num_key_value_heads=4, intermediate_size=512, moe_intermediate_size=256, n_routed_experts=16, num_experts_per_tok=4,
                        n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                        first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=None, qk_nope_head_dim=32,
                        qk_rope_head_dim=32, v_head_dim=64, topk_method="noaux_tc", scoring_func="sigmoid",
                        norm_topk_prob=True),
}


def bound(ref_logprob: float) -> float:
    """STEPS bf16 steps of the logits a logprob is made of (|logit| <= |logprob| + LOGIT_MAX here)."""
    return STEPS * BF16_STEP * (abs(ref_logprob) + LOGIT_MAX)


class AtomExperts(torch.nn.Module):
    """Drop-in for a transformers *Experts module: forward(hidden_states, top_k_index, top_k_weights)."""

    def __init__(self, experts: torch.nn.Module, top_k: int):
        super().__init__()
        e, two_i, h = experts.gate_up_proj.shape
        spec = MoESpec.create(hidden_size=h, intermediate_size=two_i // 2, num_experts=e, top_k=top_k,
                              scheme="bf16", max_tokens_per_rank=MAX_TOKENS)
        device = experts.gate_up_proj.device
        # transformers' gate_up_proj is [E, 2I, H], gate rows first (chunk(2) in its forward): SEPARATED
        weights = prepare_stacked(spec, experts.gate_up_proj.data, experts.down_proj.data, layout="separated",
                                  device=device)
        self.handle = ops.bind_experts(weights, spec, backend="triton",
                                       workspace=allocate_workspace(spec, MAX_TOKENS, device))
        self.calls = 0
        run = ops._bound[self.handle]

        def counted(x, w, ids):  # runs only when Python runs the op (eager, warm-up, recording)
            self.calls += 1
            return run(x, w, ids)
        ops._bound[self.handle] = counted

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return torch.ops.atom_moe.experts(hidden_states.contiguous(), top_k_weights.contiguous(),
                                          top_k_index.contiguous(), self.handle)


def build(model_type: str, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, **{**COMMON, **CONFIGS[model_type]})
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if "e_score_correction_bias" in name:
                t.normal_(0, 0.5)
    return model


def swap_experts(model) -> list[AtomExperts]:
    ours = []
    top_k = model.config.num_experts_per_tok
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("Experts") and hasattr(module, "gate_up_proj"):
            parent = model.get_submodule(name.rsplit(".", 1)[0])
            ours.append(AtomExperts(module, top_k))
            setattr(parent, name.rsplit(".", 1)[1], ours[-1])
    assert ours, "no experts module found"
    return ours


def generate(model, input_ids):
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=NEW_TOKENS,
                         do_sample=False, output_scores=True, return_dict_in_generate=True,
                         cache_implementation="static", disable_compile=True, pad_token_id=0)
    tokens = out.sequences[:, input_ids.shape[1]:]
    logprobs = torch.stack([s.float().log_softmax(-1) for s in out.scores], 1)  # [B, new, V]
    return tokens, logprobs


def compare(ref_tokens, ref_lp, tokens, lp) -> list[str]:
    problems = []
    for b in range(ref_tokens.shape[0]):
        for pos in range(ref_tokens.shape[1]):
            rt, gt = int(ref_tokens[b, pos]), int(tokens[b, pos])
            ref_best = float(ref_lp[b, pos, rt])
            if rt != gt:
                gap = ref_best - float(ref_lp[b, pos, gt])
                if gap > 2 * bound(ref_best):
                    problems.append(f"row {b} token {pos}: {gt} instead of {rt} (reference gap {gap:.4f})")
                break
            # every vocabulary entry at this step, not only the chosen token
            diff = (lp[b, pos] - ref_lp[b, pos]).abs()
            limit = STEPS * BF16_STEP * (ref_lp[b, pos].abs() + LOGIT_MAX)
            if (diff > limit).any():
                i = int((diff / limit).argmax())
                problems.append(f"row {b} token {pos}: logprob of {i} off by {float(diff[i]):.4f} "
                                f"(bound {float(limit[i]):.4f})")
    return problems


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_compiled_generate_with_our_experts_matches_own_experts(model_type, seed):
    pytest.importorskip("transformers")
    model = build(model_type, seed)
    g = torch.Generator().manual_seed(seed)
    batches = [torch.randint(1, 512, (2, 24), generator=g).cuda(), torch.randint(1, 512, (3, 17), generator=g).cuda()]
    with torch.no_grad():
        refs = [generate(model, ids) for ids in batches]  # the model's own experts, eager
        ours = swap_experts(model)
        eager = [generate(model, ids) for ids in batches]  # our experts, eager: the same kernels
        for (rt, rl), (t, lp) in zip(refs, eager):
            assert not compare(rt, rl, t, lp)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        model.forward = torch.compile(model.forward, mode="reduce-overhead")
        for rep in range(2):  # the second round replays graphs recorded in the first
            for ids, (rt, rl) in zip(batches, refs):
                before = sum(e.calls for e in ours)
                tokens, lp = generate(model, ids)
                problems = compare(rt, rl, tokens, lp)
                assert not problems, f"{model_type} round {rep}, batch {tuple(ids.shape)}:\n" + "\n".join(problems[:20])
                python_calls = sum(e.calls for e in ours) - before
                if rep == 1:
                    # NEW_TOKENS forwards per batch, each calling every MoE layer: replayed graphs call no Python
                    assert python_calls < len(ours) * NEW_TOKENS // 2, python_calls
    skips = torch._dynamo.utils.counters["inductor"].get("cudagraph_skips", 0)
    assert skips == 0, f"cudagraph trees skipped {skips} graph(s): {dict(torch._dynamo.utils.counters['inductor'])}"
    for e in ours:
        ops.unbind(e.handle)
