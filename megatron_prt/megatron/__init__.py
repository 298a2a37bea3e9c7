"""megatron-core integration: the only package of megatron-prt that imports megatron."""
