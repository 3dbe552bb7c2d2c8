"""fuse_channels_last_broadcasts: fuse_elementwise again after the layout pass, for the ops that pass
made slow.

An aten pointwise op broadcasting an operand into a tensor convert_channels_last made channels_last
runs in aten's strided, unvectorized kernel (``cost.model.broadcast_channels_last``, priced at the
profile's ``conv_bias_add_scale``): squeeze-and-excitation's per-channel scale in a CNN given NCHW,
which was NCHW when fuse_elementwise ran (for a model given channels_last fuse_elementwise takes such
an op itself). Each becomes a one-op ``graphopt::fused_pointwise`` that keeps the layout, where the
cost model predicts a gain; every other rule is fuse_elementwise's (its grouping, refusals, training
graphs with the fused backward).
"""

from __future__ import annotations

from graphopt.cost.model import broadcast_channels_last
from graphopt.pipeline import register

from .fuse_elementwise import FuseElementwise


@register
class FuseChannelsLastBroadcasts(FuseElementwise):
    """fuse_elementwise restricted to ops broadcasting into a channels_last tensor, after the layout pass."""

    name = "fuse_channels_last_broadcasts"
    family = "lower"
    description = "aten pointwise ops broadcasting into a channels_last tensor -> graphopt.fused_pointwise"
    requires = ("convert_channels_last",)
    affine_batch_norms = False  # (one op broadcasting into a channels_last tensor: no BatchNorm is)

    @staticmethod
    def _eligible(ok: set) -> set:
        return {n for n in ok if broadcast_channels_last(n)}
