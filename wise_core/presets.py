"""Named model architectures (`PRESETS`): the released Ouro and Huginn models' and the small
shapes of the tests."""

from __future__ import annotations

from wise_core.model_config import ModelConfig

# Ouro-1.4B / 2.6B follow the released config.json files.
PRESETS: dict[str, ModelConfig] = {
    "ouro-1.4b": ModelConfig(
        vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
        num_attention_heads=16, num_key_value_heads=16, head_dim=128, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, max_position_embeddings=65536, total_ut_steps=4,
        early_exit_threshold=1.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0),
    "ouro-2.6b": ModelConfig(
        vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=16, head_dim=128, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, max_position_embeddings=65536, total_ut_steps=4,
        early_exit_threshold=1.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0),
    # Small shapes for tests: MHA and GQA, head_dim 64 (the `-gqa` variant has 2 query heads per KV head).
    "test-tiny": ModelConfig(
        vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=64, rope_theta=10_000.0,
        rms_norm_eps=1e-6, max_position_embeddings=1024, total_ut_steps=4),
    "test-tiny-gqa": ModelConfig(
        vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=10_000.0,
        rms_norm_eps=1e-6, max_position_embeddings=1024, total_ut_steps=4),
    # huginn-0125 (tomg-group-umd), following the released RavenConfig; its generation config
    # also stops on 65508 (wise takes one eos id).
    "huginn-0125": ModelConfig(
        vocab_size=65536, hidden_size=5280, intermediate_size=17920, num_hidden_layers=8,
        num_attention_heads=55, num_key_value_heads=55, head_dim=96, rope_theta=50_000.0,
        rms_norm_eps=1e-6, max_position_embeddings=4096, total_ut_steps=32, tie_word_embeddings=True,
        bos_token_id=65504, eos_token_id=65505, pad_token_id=65509, architecture="huginn",
        n_layers_in_prelude=2, n_layers_in_recurrent_block=4, n_layers_in_coda=2, state_init="like-init",
        qk_bias=True),
    # Huginn in small shapes for tests: prelude, core block and coda of different lengths.
    "test-tiny-huginn": ModelConfig(
        vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
        num_attention_heads=2, num_key_value_heads=2, head_dim=64, rope_theta=10_000.0,
        rms_norm_eps=1e-6, max_position_embeddings=1024, total_ut_steps=4, tie_word_embeddings=True,
        architecture="huginn", n_layers_in_prelude=1, n_layers_in_recurrent_block=3, n_layers_in_coda=2,
        state_init="like-init", qk_bias=True),
}
