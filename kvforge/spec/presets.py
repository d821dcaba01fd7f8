"""Named architectures for planning without files (configs as published).

Values are the public config.json fields of each model (facts, not weights).
They let `kvforge plan llama-3.1-8b` and dummy-weight GPU runs work offline.
"""

from __future__ import annotations

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

PRESETS: dict[str, dict] = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": _LLAMA3_ROPE,
        "max_position_embeddings": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    },
    "llama-3.1-70b": {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": _LLAMA3_ROPE,
        "max_position_embeddings": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "mistral-7b": {
        "architectures": ["MistralForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "sliding_window": 4096, "max_position_embeddings": 32768,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288,
        "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "gemma-3-1b": {
        "architectures": ["Gemma3ForCausalLM"], "hidden_size": 1152, "num_hidden_layers": 26,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "intermediate_size": 6912,
        "vocab_size": 262144, "sliding_window": 512, "sliding_window_pattern": 6,
        "max_position_embeddings": 32768, "torch_dtype": "bfloat16",
    },
    "gemma-3-27b": {
        "architectures": ["Gemma3ForCausalLM"], "hidden_size": 5376, "num_hidden_layers": 62,
        "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128, "intermediate_size": 21504,
        "vocab_size": 262208, "sliding_window": 1024, "sliding_window_pattern": 6,
        "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
    },
    "gpt-oss-20b": {
        "architectures": ["GptOssForCausalLM"], "hidden_size": 2880, "num_hidden_layers": 24,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2880,
        "num_local_experts": 32, "num_experts_per_tok": 4, "vocab_size": 201088, "sliding_window": 128,
        "max_position_embeddings": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "deepseek-v2-lite": {
        "architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 27,
        "num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "vocab_size": 102400, "max_position_embeddings": 163840,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512, "q_lora_rank": 1536,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "first_k_dense_replace": 3, "moe_layer_freq": 1, "n_group": 8, "topk_group": 4,
        "vocab_size": 129280, "max_position_embeddings": 163840, "tie_word_embeddings": False,
        "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16",
    },
    "kimi-k2": {
        "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168, "num_hidden_layers": 61,
        "num_attention_heads": 64, "num_key_value_heads": 64, "kv_lora_rank": 512, "q_lora_rank": 1536,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
        "vocab_size": 163840, "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "qwen3-next-80b-a3b": {
        "architectures": ["Qwen3NextForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 48,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "intermediate_size": 5120,
        "moe_intermediate_size": 512, "num_experts": 512, "num_experts_per_tok": 10,
        "shared_expert_intermediate_size": 512, "full_attention_interval": 4, "linear_num_value_heads": 32,
        "linear_num_key_heads": 16, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "vocab_size": 151936, "max_position_embeddings": 262144,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "mtp_num_hidden_layers": 1,
    },
    "kimi-linear-48b-a3b": {
        "architectures": ["KimiLinearForCausalLM"], "hidden_size": 2304, "num_hidden_layers": 27,
        "num_attention_heads": 32, "num_key_value_heads": 32, "kv_lora_rank": 512, "q_lora_rank": None,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "intermediate_size": 9216,
        "moe_intermediate_size": 1024, "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1,
        "first_k_dense_replace": 1, "linear_attn_config": {
            "head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4,
            "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
            "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26]},
        "vocab_size": 163840, "max_position_embeddings": 1048576, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "csa-ring-test": {
        "architectures": ["CsaRingTestForCausalLM"], "hidden_size": 1024, "num_hidden_layers": 4,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 192, "intermediate_size": 2048,
        "vocab_size": 32000, "ring_rows": 7, "ring_row_bytes": 1024, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
}
