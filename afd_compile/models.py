"""Small Hugging Face decoders with random weights, built offline, and their export.

Used by the demo, the tests and the benchmarks. ``transformers`` is imported lazily: the core
passes do not need it.
"""

from __future__ import annotations

from typing import Any

import torch

#: Tiny configs per family: (transformers class name, config class name, config kwargs).
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=128, decoder_sparse_step=1, mlp_only_layers=[])),
    # fused qkv_proj and gate_up_proj weights, sliced apart in the graph
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)),
    # explicit (eager) attention with logit soft-capping, sandwich norms
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128)),
    # Conv1D projections (addmm with weight [in, out]), fused c_attn split into q/k/v, biases
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(
        vocab_size=128, n_embd=64, n_head=4, n_positions=128, bos_token_id=0, eos_token_id=0)),
    # q/k RMSNorm over all heads before the head split; norms after attention and MLP
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=0, eos_token_id=0)),
    # scalar multipliers on the embedding, the residual branches and the logits
    "granite": ("GraniteForCausalLM", "GraniteConfig", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, residual_multiplier=0.5)),
    # parallel residual, interleaved rotary (stack + flatten), biases
    "gptj": ("GPTJForCausalLM", "GPTJConfig", dict(
        vocab_size=128, n_embd=64, n_head=4, rotary_dim=8, n_positions=128, bos_token_id=0, eos_token_id=0)),
    # relu^2 MLP (aten.square), LayerNorm with a (1 + weight) scale
    "nemotron": ("NemotronForCausalLM", "NemotronConfig", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=0, eos_token_id=0)),
    # fused query_key_value packed per KV group [q.. | k | v] (new decoder architecture), x @ W.T
    # (numpy_T), K/V picked out of each group by index and broadcast_to, parallel attention + MLP
    "falcon": ("FalconForCausalLM", "FalconConfig", dict(
        vocab_size=128, hidden_size=64, num_attention_heads=4, new_decoder_architecture=True, num_kv_heads=2,
        bos_token_id=0, eos_token_id=0)),
    # MLA (low-rank q / kv projections, shared rotary key part), group-limited sigmoid routing,
    # shared experts, the first layer dense
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=128, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, bos_token_id=0, eos_token_id=0)),
    # ALiBi scores in one baddbmm (bias + q @ k^T) over batch * heads, an MLP module that adds the
    # residual itself (mlp(x, residual)), fused query_key_value packed per head
    "bloom": ("BloomForCausalLM", "BloomConfig", dict(
        vocab_size=128, hidden_size=64, n_head=4, bos_token_id=0, eos_token_id=0, pad_token_id=0)),
    # ALiBi bias over all heads added to explicit q @ k^T scores, fused Wqkv, an MLP module that
    # adds the residual itself, LayerNorm without bias
    "mpt": ("MptForCausalLM", "MptConfig", dict(
        vocab_size=128, d_model=64, n_heads=4, max_seq_len=128, bos_token_id=0, eos_token_id=0, pad_token_id=0)),
    # attention sinks (a learned logit per head joined to the scores by cat), sliding-window layers
    # alternating with full ones, experts with biases and an interleaved gate_up ([..., ::2] / [..., 1::2])
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig", dict(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=131072, sliding_window=3,
        pad_token_id=0, bos_token_id=0, eos_token_id=0)),
    # sparsemixer routing: the top expert picked by max over the router logits, no topk
    "phimoe": ("PhimoeForCausalLM", "PhimoeConfig", dict(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=0,
        eos_token_id=0)),
    # RMSNorms inside the blocks: over all heads of the attention output before o_proj, and over
    # the intermediate size before down_proj (each a mean over a TP-split dim)
    "bitnet": ("BitNetForCausalLM", "BitNetConfig", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, pad_token_id=0, bos_token_id=0, eos_token_id=0)),
    # hybrid: a gated delta-net (linear attention, its own recurrent state) in layer 0, gated full
    # attention in layer 1, each followed by an MoE with a gated shared expert
    "qwen3_next": ("Qwen3NextForCausalLM", "Qwen3NextConfig", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[],
        layer_types=["linear_attention", "full_attention"], max_position_embeddings=128, pad_token_id=0,
        bos_token_id=0, eos_token_id=0)),
    # hybrid: a Mamba state-space mixer in layer 0 (selective scan written in torch), attention in
    # layer 1, each followed by an MoE
    # Qwen3.5: gated delta-net linear attention (a depthwise short convolution over q | k | v, a chunked
    # recurrence per head) then full attention, each with an MLP
    "qwen3_5": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "jamba": ("JambaForCausalLM", "JambaConfig", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, expert_layer_period=1, expert_layer_offset=0, attn_layer_period=2,
        attn_layer_offset=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8,
        max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # hybrid, every mixer a block of its own (``layers.N.mixer``): attention, MoE (relu2 experts, a shared
    # expert), MLP, Mamba, MoE, attention, MLP; the MLP and MoE blocks end the layers (passes/mixer_blocks.py):
    # [attention MoE] [MLP] [Mamba MoE] [attention MLP]
    "nemotron_h": ("NemotronHForCausalLM", "NemotronHConfig", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, hybrid_override_pattern="*E-ME*-", ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=16,
        n_groups=1, chunk_size=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32, n_shared_experts=1, n_group=1, topk_group=1,
        max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # a dense MLP and an MoE side by side in each layer, the MoE's router, experts and norms the layer's own
    # children (not under its mlp), the router reading the residual, the experts their own norm of it
    "gemma4_moe": ("Gemma4ForCausalLM", "Gemma4TextConfig", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
        hidden_size_per_layer_input=0, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # dense, with per-layer inputs: after the MLP each layer mixes a slice of an embedding of its own into the
    # residual (a gate and a projection of attention role that read the residual, not attention's output)
    "gemma4": ("Gemma4ForCausalLM", "Gemma4TextConfig", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, hidden_size_per_layer_input=16, vocab_size_per_layer_input=128, max_position_embeddings=128,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # MLA with a sparse-attention indexer (its own projections pick the keys each query attends: the mask)
    "deepseek_v32": ("DeepseekV32ForCausalLM", "DeepseekV32Config", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
        head_dim=8, max_position_embeddings=128, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, n_shared_experts=1, bos_token_id=0, eos_token_id=0, pad_token_id=0)),
    # MLA-style attention with a sparse-attention indexer written out (eager: matmul, sinks joined to the scores),
    # four residual streams mixed by hyper-connections, MoE after a dense first layer
    "hy_v4": ("HYV4ForCausalLM", "HYV4Config", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
        head_dim=8, max_position_embeddings=128, n_routed_experts=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_shared_experts=1, bos_token_id=1, eos_token_id=2,
        pad_token_id=0)),
    # attention sinks as a scale on the attention output, sigmoid(logsumexp(scores) - sink), per head
    "granite_swa": ("GraniteSWAForCausalLM", "GraniteSWAConfig", dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # multi-query attention: fused c_attn [q | one K head | one V head]
    "gpt_bigcode": ("GPTBigCodeForCausalLM", "GPTBigCodeConfig", dict(
        vocab_size=128, n_embd=64, n_head=4, n_positions=128, bos_token_id=0, eos_token_id=0)),
}


#: parameters a family's init leaves equal across heads (zeros), drawn at random here so that a
#: split that read the wrong head's would show
RANDOM_INIT = {"granite_swa": ("sinks",)}


class LogitsOnly(torch.nn.Module):
    """``model(input_ids).logits`` without a KV cache: the graph we export."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def build_hf(family: str, num_layers: int = 2, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A tiny HF causal LM with random weights (seeded), wrapped to return logits."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r} (known: {sorted(FAMILIES)})")
    model_cls, cfg_cls, kwargs = FAMILIES[family]
    experts_impl = overrides.pop("experts_implementation", None)
    cfg = getattr(transformers, cfg_cls)(**{**kwargs, "num_hidden_layers": num_layers, **overrides})
    torch.manual_seed(seed)
    extra = {"experts_implementation": experts_impl} if experts_impl else {}
    cls = getattr(transformers, model_cls)
    model = cls._from_config(cfg, **extra) if extra else cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in RANDOM_INIT.get(family, ())):
                p.uniform_(-1.0, 1.0)
    return LogitsOnly(model.eval())


def export_lm(model: torch.nn.Module, batch: int = 2, seq: int = 5, *, dynamic: bool = True,
              vocab_size: int = 128, seed: int = 0, device: torch.device | str = "cpu"
              ) -> torch.export.ExportedProgram:
    """Export with ``input_ids`` of shape (batch, seq) on ``device`` (the model's: constants the
    trace creates, such as rotary positions, are made there); batch and sequence dynamic by default."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq), generator=g).to(device)
    shapes = None
    if dynamic:
        # batch is the dimension the split relies on; the sequence is AUTO: dynamic where the
        # model allows it (torch 2.11 cannot prove some of HF's mask guards for a named seq Dim)
        shapes = {"input_ids": {0: torch.export.Dim("batch", min=1, max=1024), 1: torch.export.Dim.AUTO}}
    with torch.no_grad():
        return torch.export.export(model, (ids,), dynamic_shapes=shapes)


def export_cached_lm(model: torch.nn.Module, batch: int = 2, max_cache_len: int = 32, seq: int = 4,
                     max_seq: int = 16, static: bool = False) -> torch.export.ExportedProgram:
    """Export a transformers causal LM with its static KV cache, the ecosystem's way
    (``transformers.integrations.executorch.TorchExportableModuleForDecoderOnlyLM``): the cache
    as buffers updated in place, inputs ``input_ids`` [batch, seq] and ``cache_position`` [seq],
    the sequence dynamic (1..``max_seq``: a prefill of ``seq`` tokens, then one-token decode
    steps; an FFN rank fanning in several attention ranks needs a dynamic token count, and the
    cache fixes the batch). ``static``: every shape fixed, ``seq`` tokens per sequence (the
    exporter's own default, one decode token per sequence, with ``seq=1``)."""
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    inner = model.model if isinstance(model, LogitsOnly) else model
    inner.generation_config.cache_implementation = "static"
    wrapped = TorchExportableModuleForDecoderOnlyLM(inner, batch_size=batch, max_cache_len=max_cache_len)
    dim = torch.export.Dim("seq", min=1, max=max_seq)
    # the saved example is what verify runs (token ids shifted per rank and step): real ids, not zeros
    ids = torch.randint(1, inner.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return wrapped.export(input_ids=ids, cache_position=torch.arange(seq),
                              dynamic_shapes=None if static else {"input_ids": {1: dim}, "cache_position": {0: dim}})
