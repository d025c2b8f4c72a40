"""Attention analysis: the two softmax maps, λ and the differential map of every head (`maps`), metrics on them, and
figures (`plotting`, needs matplotlib: the `[analysis]` extra)."""

from .maps import (
    LayerMaps,
    attention_maps,
    entropy,
    iter_attention_maps,
    lambda_per_layer,
    layer_metrics,
    model_kind,
    negative_fraction,
    noise_mass,
    span_mass,
)


__all__ = [
    "LayerMaps",
    "attention_maps",
    "entropy",
    "iter_attention_maps",
    "lambda_per_layer",
    "layer_metrics",
    "model_kind",
    "negative_fraction",
    "noise_mass",
    "span_mass",
]
