"""MoE models on megatron-core: the transformer config, GPT-MoE and a layout-free weight init."""
