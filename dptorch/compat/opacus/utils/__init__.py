"""Opacus' ``opacus.utils`` paths: ``batch_memory_manager``, ``uniform_sampler``, ``fast_gradient_clipping_utils``."""
